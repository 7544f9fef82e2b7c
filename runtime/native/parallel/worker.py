"""A tensor-parallel rank other than 0: it loads its shard, then runs each step rank 0 hands it until told to stop.

Rank 0 (``LLM.load`` of a tensor-parallel engine) starts these on its own host:

    python -m kiln.runtime.native.parallel.worker ENGINE_DIR --rendezvous HOST:PORT --rank R --size N
                                                  --local-rank GPU [--options JSON]

Across hosts, ``torchrun`` starts ``kiln serve ENGINE`` on every rank, which calls ``run_worker`` on ranks 1..N-1.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.runtime.engine_process.lifetime import die_with_parent, leave_stop_signals_to_parent, outlive_parent_thread
from kiln.runtime.errors import TensorParallelError
from kiln.runtime.logs import log_as_parent
from kiln.runtime.native.engine_format import ENGINE_JSON, EngineConfig
from kiln.runtime.native.fingerprint import resolve_device
from kiln.runtime.native.model_runner import ModelRunner
from kiln.runtime.native.parallel.channel import StepChannel
from kiln.runtime.native.parallel.group import Rendezvous, TensorParallelGroup
from kiln.runtime.native.parallel.step_batch import STOP, StepBatch
from kiln.runtime.options import RuntimeOptions

logger = logging.getLogger("kiln.runtime")


def rank_device(engine_device: torch.device, local_rank: int) -> torch.device:
    """The device of a rank: the CPU for a CPU engine, else GPU ``local_rank`` of this host."""
    return engine_device if engine_device.type == "cpu" else torch.device("cuda", local_rank)


def engine_digest(engine_dir: Path) -> str:
    """What tells one build of an engine from another: the sha256 of its engine.json, which every rank's must
    match (a build's weights change its recorded key material, and so this file)."""
    return hashlib.sha256((Path(engine_dir) / ENGINE_JSON).read_bytes()).hexdigest()


def rank_key(what: str, rank: int) -> str:
    """The store key under which rank ``rank`` tells rank 0 ``what``: ``engine``, the build it loads
    (``engine_digest``); ``loaded``, that its shard is loaded and it no longer dies with the thread that started it;
    ``error``, the error it stops with."""
    return f"{what}/{rank}"


def require_ranks(engine_dir: Path, rendezvous: Rendezvous) -> EngineConfig:
    """The engine's config; TensorParallelError when its tp_size is not the rendezvous' number of ranks (torchrun's
    WORLD_SIZE)."""
    config = EngineConfig.load(engine_dir)
    if rendezvous.size != config.tp_size:
        raise TensorParallelError(f"{engine_dir}: an engine of tp_size {config.tp_size} cannot run on "
                                  f"{rendezvous.size} ranks; start as many ranks as its tp_size (torchrun "
                                  f"--nproc-per-node and --nnodes)")
    return config


def run_worker(engine_dir: Path, options: RuntimeOptions, rendezvous: Rendezvous, device: torch.device,
               on_loaded: Callable[[], None] | None = None, on_joined: Callable[[], None] | None = None) -> None:
    """Join the engine's ranks, load this rank's shard on ``device`` and run rank 0's steps until it says stop;
    ``on_joined`` runs once rank 0's store has taken this rank."""
    config = require_ranks(engine_dir, rendezvous)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches and graph captures go to the current device
    tp = TensorParallelGroup(rendezvous, device)
    if on_joined is not None:
        on_joined()
    try:
        tp.store.set(rank_key("engine", rendezvous.rank), engine_digest(engine_dir))  # rank 0 checks it is its build
        channel = StepChannel(tp.store)
        runner = ModelRunner(engine_dir, config, device, options, tp=tp)
        if on_loaded is not None:
            on_loaded()  # from here rank 0's store tells this rank when rank 0 has gone
        tp.store.set(rank_key("loaded", rendezvous.rank), "1")  # rank 0's load returns once every rank has said so
        with torch.inference_mode():
            while (message := channel.receive()) != STOP:
                runner.execute(StepBatch.decode(message))
    except Exception as e:  # rank 0's error (a server's /health, a load that fails) says why, not only "exited"
        with contextlib.suppress(Exception):  # the store may be what failed
            tp.store.set(rank_key("error", rendezvous.rank), f"{type(e).__name__}: {e}")
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--rendezvous", required=True, help="HOST:PORT of rank 0's store")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True, help="this rank's GPU on its host")
    parser.add_argument("--options", default="{}", help="RuntimeOptions as a JSON object (rank 0's)")
    parser.add_argument("--parent-pid", type=int, help="rank 0's pid (a local worker): die with it while loading")
    parser.add_argument("--log-level", type=int, default=logging.NOTSET, help="rank 0's (0: none set, none added)")
    parser.add_argument("--log-config", default="", help="the logging configuration file rank 0 applied, if any")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    leave_stop_signals_to_parent()
    log_as_parent(args.log_level, args.log_config)
    options = RuntimeOptions(**json.loads(args.options))
    device = resolve_device(options.device, EngineConfig.load(args.engine_dir).fingerprint)
    try:
        run_worker(args.engine_dir, options, Rendezvous.parse(args.rendezvous, args.rank, args.size),
                   rank_device(device, args.local_rank),
                   on_loaded=outlive_parent_thread if args.parent_pid is not None else None)
    except Exception as exc:  # rank 0 reports it (the store holds it): one line here, the traceback at debug
        logger.error("tensor-parallel worker rank %d stopped: %s: %s", args.rank, type(exc).__name__, exc)
        logger.debug("rank %d's traceback", args.rank, exc_info=exc)
        sys.exit(1)



if __name__ == "__main__":
    main()
