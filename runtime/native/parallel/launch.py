"""Rank 0 starts the other ranks of a tensor-parallel engine on its own host, watches them and stops them.

Each worker is ``python -m kiln.runtime.native.parallel.worker``; a worker that exits while the engine runs aborts
rank 0's collectives, so the engine stops with an error that names the rank instead of waiting.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict
from pathlib import Path

import torch

from kiln.runtime.errors import FingerprintMismatchError
from kiln.runtime.kiln_python import kiln_module_command
from kiln.runtime.logs import child_logging
from kiln.runtime.native.parallel.channel import StepChannel
from kiln.runtime.native.parallel.group import (
    COLLECTIVE_TIMEOUT,
    Rendezvous,
    TensorParallelError,
    TensorParallelGroup,
)
from kiln.runtime.native.parallel.step_batch import STOP
from kiln.runtime.native.parallel.worker import engine_digest, rank_device, rank_key
from kiln.runtime.options import RuntimeOptions

STOP_TIMEOUT_S = 30
JOIN_POLL_S = 0.2
FAILURE_WAIT_S = 2.0
WORKER_EXIT_WAIT_S = 30.0


def check_devices(device: torch.device, tp_size: int) -> None:
    """A CUDA engine of ``tp_size`` ranks needs that many GPUs from ``device`` on (a CPU engine runs its ranks as
    processes of this host)."""
    if device.type != "cuda":
        return
    available = torch.cuda.device_count() - (device.index or 0)
    if available < tp_size:
        raise FingerprintMismatchError(f"the engine is split over {tp_size} GPUs (tp_size {tp_size}) but this machine "
                                       f"has {available} from {device} on; run it on a machine with {tp_size} GPUs, "
                                       f"or rebuild it with a smaller build.tp_size")


class LocalWorkers:
    """Ranks 1..size-1 as child processes of this one; ``rendezvous`` is rank 0's place among them."""

    def __init__(self, engine_dir: Path, options: RuntimeOptions, size: int, first_local_rank: int = 0) -> None:
        # the store listens on the loopback interface only, on a socket bound before any worker is told its port
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        self.rendezvous = Rendezvous("127.0.0.1", port, 0, size, listener.detach())  # the store owns the socket
        self.failure: str | None = None
        self.failed = threading.Event()
        self._stopping = False
        self.processes = {}
        log_level, log_config = child_logging()  # each worker logs as this process does
        for rank in range(1, size):
            command, env = kiln_module_command(
                "kiln.runtime.native.parallel.worker", str(engine_dir), "--rendezvous", self.rendezvous.address(),
                "--rank", str(rank), "--size", str(size), "--local-rank", str(first_local_rank + rank),
                "--options", json.dumps(asdict(options)), "--parent-pid", str(os.getpid()),
                "--log-level", log_level, "--log-config", log_config)
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no c10d warning per idle poll of the step channel
            self.processes[rank] = subprocess.Popen(command, env=env)

    def pids(self) -> dict[int, int]:
        """The process id of each worker that has not exited, by rank."""
        return {rank: process.pid for rank, process in self.processes.items() if process.returncode is None}

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call ``on_failure`` with what happened when a worker exits before ``stop``."""
        def wait(rank: int, process: subprocess.Popen) -> None:
            code = process.wait()
            if not self._stopping and self.failure is None:
                self.failure = f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {code}"
                self.failed.set()
                on_failure(self.failure)

        for rank, process in self.processes.items():
            threading.Thread(target=wait, args=(rank, process), daemon=True, name=f"kiln-tp-watch-{rank}").start()

    def stop(self, kill: bool = False) -> None:
        """Wait for the workers to leave (rank 0 has told them to), killing any that do not (all, with ``kill``)."""
        self._stopping = True
        for process in self.processes.values():
            try:
                process.wait(0 if kill else STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class TensorParallelRanks:
    """Rank 0's side of a tensor-parallel engine: its group, its step channel and the other ranks. Those are worker
    processes it starts on this host, or, with ``options.tp_rendezvous``, workers started elsewhere (torchrun) that
    meet it there. A local worker that exits while the engine runs aborts the group, and ``failure`` says which; a
    remote one ends the next collective after its timeout."""

    def __init__(self, engine_dir: Path, options: RuntimeOptions, size: int, device: torch.device) -> None:
        local_rank = device.index or 0
        self.workers: LocalWorkers | None = None
        if options.tp_rendezvous is not None:
            check_devices(device, 1)
            self.group = self._join(Rendezvous.parse(options.tp_rendezvous, 0, size),
                                    rank_device(device, local_rank))
        else:
            check_devices(device, size)
            self.workers = LocalWorkers(engine_dir, options, size, local_rank)
            try:
                self.group = self._join(self.workers.rendezvous, rank_device(device, local_rank))
            except BaseException:
                self.workers.stop(kill=True)
                raise
            self.workers.watch(lambda _: self.group.abort())
        self._check_same_build(engine_dir, size)
        self.channel = StepChannel(self.group.store)

    def _check_same_build(self, engine_dir: Path, size: int) -> None:
        """Refuse ranks that load another build of the engine (hosts given different copies): their shards would
        not add up, and the output would be wrong without an error. However it fails (another build, a rank that
        exited, the timeout, Ctrl-C), no local worker outlives it."""
        try:
            self._compare_builds(engine_dir, size)
        except BaseException:
            self.stop_workers()
            raise

    def _compare_builds(self, engine_dir: Path, size: int) -> None:
        ours = engine_digest(engine_dir)
        self._wait_for_keys([rank_key("engine", rank) for rank in range(1, size)], "say which engine they load")
        for rank in range(1, size):
            theirs = self.group.store.get(rank_key("engine", rank)).decode()
            if theirs != ours:
                raise TensorParallelError(f"tensor-parallel rank {rank} loads another build of this engine (its "
                                          f"engine.json sha256 {theirs[:12]}, rank 0's {ours[:12]}): give every rank "
                                          f"the same engine directory or cache key")

    @property
    def failure(self) -> str | None:
        """Which local worker exited, with the error it left in the store where it left one."""
        failure = None if self.workers is None else self.workers.failure
        if failure is None:
            return None
        store = self.group.store
        errors = [store.get(key).decode() for rank in range(1, self.group.size)
                  if store.check([key := rank_key("error", rank)])]
        return f"{failure} ({'; '.join(errors)})" if errors else failure

    def failure_after_error(self, timeout_s: float = FAILURE_WAIT_S) -> str | None:
        """Why a collective just failed: a local worker's exit, which its watcher may record a moment after the
        broken connection shows (None when no worker exited). A worker that left its error in the store is
        exiting: its exit is waited for longer (a loaded host may take seconds to reap it)."""
        if self.workers is not None:
            deadline = time.monotonic() + timeout_s
            while not self.workers.failed.wait(JOIN_POLL_S):
                if self._worker_left_an_error():
                    self.workers.failed.wait(WORKER_EXIT_WAIT_S)
                    break
                if time.monotonic() > deadline:
                    break
        return self.failure

    def _worker_left_an_error(self) -> bool:
        """Whether another rank stored why it fails (it then exits)."""
        return any(self.group.store.check([rank_key("error", rank)]) for rank in range(1, self.group.size))

    def wait_for_workers_loaded(self) -> None:
        """Return once every other rank has said its shard is loaded: a local worker dies with the thread that
        started it until then, which an ``LLM.load`` on a thread of its own may end as soon as rank 0 is done."""
        self._wait_for_keys([rank_key("loaded", rank) for rank in range(1, self.group.size)], "load")

    def _wait_for_keys(self, keys: list[str], waiting_for: str) -> None:
        """Return once the other ranks have set ``keys`` in the store. Polled, not the store's own wait (one C++ call
        for its whole timeout): a local worker that exits meanwhile is an error at once, and Ctrl-C is handled."""
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not self.group.store.check(keys):
            if (failure := self.failure) is not None:
                raise TensorParallelError(f"{failure} while the engine was loading")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"the other tensor-parallel ranks did not {waiting_for} within "
                                          f"{COLLECTIVE_TIMEOUT.total_seconds():.0f} s")
            time.sleep(JOIN_POLL_S)

    def stop_workers(self) -> None:
        """Kill the local workers at once (rank 0 failed while loading)."""
        if self.workers is not None:
            self.workers.stop(kill=True)

    def _join(self, rendezvous: Rendezvous, device: torch.device) -> TensorParallelGroup:
        """The group, formed on a thread while this one watches the workers: one that dies first is an error
        naming it, not a wait for the rendezvous timeout."""
        # a daemon thread, not a ThreadPoolExecutor's: if the load fails (a worker died, Ctrl-C), the thread stays
        # in gloo's rendezvous until its timeout and must not keep the interpreter from exiting
        joined: Future = Future()

        def join() -> None:
            try:
                joined.set_result(TensorParallelGroup(rendezvous, device))
            except BaseException as e:
                joined.set_exception(e)

        threading.Thread(target=join, daemon=True, name="kiln-tp-join").start()
        while True:
            try:
                return joined.result(timeout=JOIN_POLL_S)
            except FutureTimeout:
                for rank, process in (self.workers.processes if self.workers else {}).items():
                    if process.poll() is not None:
                        raise TensorParallelError(f"tensor-parallel worker rank {rank} exited with code "
                                                  f"{process.returncode} while the engine was loading (its error is "
                                                  f"above)") from None

    def close(self) -> None:
        """Tell the workers to stop and wait for the local ones."""
        if self.failure is None:
            self.channel.send(STOP)
        if self.workers is not None:
            self.workers.stop()

