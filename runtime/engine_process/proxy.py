"""``ProcessEngine``: the ``Engine`` interface over an engine that runs in a child process.

The child owns the device and does everything a step does, sampling and detokenization included; this process keeps
tokenization and validation (``make_request``) and the routing of results. Python's GIL is then not shared between
the engine's host work and whatever else this process runs (an HTTP server's event loop, an embedding service).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import weakref
from collections import Counter
from dataclasses import asdict, replace
from multiprocessing.connection import Connection
from pathlib import Path

from kiln.runtime.engine_process.wire import (
    error_from_wire,
    receive,
    request_to_wire,
    result_from_wire,
    send,
)
from kiln.runtime.errors import EngineProcessError
from kiln.runtime.kiln_python import kiln_module_command
from kiln.runtime.limits import EngineLimits
from kiln.runtime.logs import child_logging
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.outputs import RequestFailure, StreamDelta
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence
from kiln.runtime.tokenizer import Tokenizer, encode_prompt

# a healthy child frees its engine and exits in seconds; a hung one is killed after as long as LLM.close gives a
# step (its STEP_GRACE_S), so that a drain ends that much after --shutdown-timeout, as docs/serving.md says
CLOSE_TIMEOUT_S = 10
WARM_POLL_S = 0.01  # how long ``warm_up_step`` waits for the child's word before the caller handles its commands
logger = logging.getLogger("kiln.runtime")


class ProcessEngine:
    """An engine loaded by ``factory(**arguments)`` (a ``"module:function"``) in a child process; use
    ``ProcessEngine.load`` for an engine directory. Its methods are called as ``LLM`` calls an ``Engine``'s."""

    def __init__(self, factory: str, arguments: dict) -> None:
        ours, theirs = socket.socketpair()
        argv, environment = kiln_module_command("kiln.runtime.engine_process", str(theirs.fileno()), str(os.getpid()),
                                                *child_logging())  # the child logs as this does
        # OpenMP threads that spin between torch's CPU ops took the cores this process needs to pass the results on:
        # on a busy 2-core host a 20-token completion took 3-5 s instead of 0.5 (unless the user chose a policy)
        environment.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        with theirs:  # in a session of its own: ``_kill`` kills its tensor-parallel workers with it
            self._process = subprocess.Popen(argv, pass_fds=[theirs.fileno()], env=environment,
                                             start_new_session=True)
        self._conn = Connection(ours.detach())
        _live.add(self)
        # the ids of the requests in the child, each counted: LLM frees a cancelled request's id at once, so one may be
        # reused before the child's final delta for the first
        self._unfinished: Counter[str] = Counter()
        # the child has work left (a step queued ahead for a request that has already finished here): its reply
        # after that step says it is idle and carries the idle stats
        self._child_busy = False
        self._warm = False  # the child has said that its deferred warm-up is done
        self._adds: list[dict] = []  # requests added since the last message, sent in the next one
        try:
            send(self._conn, {"factory": factory, "arguments": arguments})
            hello = self._receive()
        except BaseException:  # the child died, or this process was interrupted while it loaded
            self._kill()
            self._process.wait()
            self._conn.close()
            raise
        if "error" in hello:
            self._process.wait()
            self._conn.close()
            raise error_from_wire(hello["error"], default=EngineProcessError)
        self.limits = EngineLimits(**hello["limits"])
        self.tokenizer = Tokenizer.from_dict(hello["tokenizer"]) if hello["tokenizer"] is not None else None
        self._stats: dict = hello["stats"]
        self._worker_pids = dict(hello["worker_pids"])

    @classmethod
    def load(cls, engine_dir: Path, options: RuntimeOptions) -> ProcessEngine:
        """The engine of ``engine_dir`` with ``options``, loaded and run in a child process."""
        child_options = asdict(replace(options, engine_process=False))
        return cls("kiln.runtime.engine_process.child:load", {"engine_dir": str(engine_dir), "options": child_options})

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._process.pid

    @property
    def worker_pids(self) -> dict[int, int]:
        """The process ids, by rank, of the tensor-parallel workers that the engine process started (its children,
        gone with it: none once it has exited)."""
        return self._worker_pids if self._process.poll() is None else {}

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenize and validate a request here, as the engine in the child would (safe from any thread)."""
        token_ids = encode_prompt(prompt, self.tokenizer, self.limits.vocab_size, bool(params.stop))
        return Sequence(request_id, token_ids, self.limits.taken(len(token_ids), params))

    def add_request(self, seq: Sequence) -> None:
        """Take a request for the child: the requests added between two steps reach it in one message, so that it
        takes them all before it steps (requests queued together start together, as in a thread's engine)."""
        self._adds.append(request_to_wire(seq))
        self._unfinished[seq.request_id] += 1
        self._child_busy = True

    def abort_request(self, request_id: str) -> StreamDelta | None:
        """Ask the child to abort; its final delta arrives with a later step (None is returned at once)."""
        if request_id in self._unfinished:
            self._send_adds()
            self._send({"abort": request_id})
        return None

    def step(self) -> list[StreamDelta | RequestFailure]:
        """The results of the child's next step (or of adds and aborts it applied)."""
        self._send_adds()
        return self._take(self._receive())

    def interrupt(self) -> bool:
        """Kill the engine process: a step waiting on it then ends with its exit."""
        self._kill()
        return True

    def failure(self) -> EngineProcessError | None:
        """The engine process's exit, noticed without a message (while idle); None while it runs."""
        return None if self._process.poll() is None else self._exited()

    def warm_up_step(self) -> bool:
        """Whether the child is still warming up: it does so by itself while idle and says when it is done (waited
        for here at most ``WARM_POLL_S``)."""
        if not self._warm and self._conn.poll(WARM_POLL_S):
            self._take(self._receive())
        return not self._warm

    def _take(self, message: dict) -> list[StreamDelta | RequestFailure]:
        """The results of one of the child's messages, after noting its stats and whether it is warm."""
        if "fatal" in message:
            raise error_from_wire(message["fatal"], default=EngineProcessError)
        if "stats" in message:
            self._stats = message["stats"]
        self._child_busy = not message.get("idle", False)
        self._warm = self._warm or message.get("warm", False)
        results = [result_from_wire(item) for item in message["results"]]
        for result in results:
            if (isinstance(result, RequestFailure) or result.finished) and result.request_id in self._unfinished:
                self._unfinished[result.request_id] -= 1
                if not self._unfinished[result.request_id]:
                    del self._unfinished[result.request_id]
        return results

    def has_unfinished(self) -> bool:
        """Whether a request is unfinished, or the child still has a step to collect (its reply is awaited, so that
        its stats never stay those of a busy engine)."""
        return bool(self._unfinished) or self._child_busy

    def stats_snapshot(self) -> dict:
        """The child's latest stats (sent at most ``STATS_INTERVAL_S`` apart while it runs, and when it goes idle)."""
        return self._stats

    def close(self) -> None:
        """Ask the child to release the engine and exit; kill it if it has not within ``CLOSE_TIMEOUT_S``."""
        with contextlib.suppress(EngineProcessError):
            self._send({"close": True})
        try:
            self._process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the engine process (pid %s) did not exit within %s s of close: killed", self._process.pid,
                           CLOSE_TIMEOUT_S)
            self._kill()
            self._process.wait()
        finally:
            self._conn.close()

    def _kill(self) -> None:
        """SIGKILL the engine process and every process of its group: its tensor-parallel workers, which would
        otherwise live on (a hung one holding its GPU) once it is gone."""
        if self._process.poll() is None:  # not reaped: its id is still its group's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)

    def _send_adds(self) -> None:
        if self._adds:
            adds, self._adds = self._adds, []
            self._send({"add": adds})

    def _send(self, message: dict) -> None:
        try:
            send(self._conn, message)
        except OSError:
            raise self._exited() from None

    def _receive(self) -> dict:
        try:
            return receive(self._conn)
        except (EOFError, OSError):
            raise self._exited() from None

    def _exited(self) -> EngineProcessError:
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return EngineProcessError(f"the engine process (pid {self._process.pid}) {how}; its own error, if it had "
                                  f"one, is in the log above")


_live: weakref.WeakSet[ProcessEngine] = weakref.WeakSet()


def _close_sockets_in_fork() -> None:
    """A fork of this process holds a copy of each engine process's socket, which would keep that engine process
    (and its device memory) alive after this process has gone until the fork exits: the fork closes its copies."""
    for engine in list(_live):
        with contextlib.suppress(OSError):
            engine._conn.close()
    _live.clear()


os.register_at_fork(after_in_child=_close_sockets_in_fork)
