"""The engine interface that ``LLM`` drives, and the choice of backend for an engine directory.

A backend is a folder of ``runtime`` (``native/``, ``trtllm/``) whose engine class has the methods below. ``LLM``
calls them from its one engine thread, except ``make_request`` (tokenize and validate), ``failure`` and
``stats_snapshot``, which are safe from any thread; a new backend implements this protocol and a line in
``engine_loader``. Where an engine has them, ``LLM`` also reads its ``pid`` (the process it runs in, when that is not
this one) and ``worker_pids`` (its tensor-parallel workers on this host, by rank), for a server's process metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from kiln.runtime.errors import KilnError
from kiln.runtime.limits import EngineLimits
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.outputs import RequestFailure, StreamDelta
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence
from kiln.runtime.tokenizer import Tokenizer


class Engine(Protocol):
    """Requests in, one step at a time, deltas out."""

    tokenizer: Tokenizer | None
    limits: EngineLimits

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenize and validate a request without touching engine state; raise what a bad request gets."""

    def add_request(self, seq: Sequence) -> None:
        """Take a request made by ``make_request``."""

    def step(self) -> list[StreamDelta | RequestFailure]:
        """Advance every request once: what each gained, or why it failed."""

    def abort_request(self, request_id: str) -> StreamDelta | None:
        """Finish a request with reason "abort"; None when it is not (or no longer) here."""

    def has_unfinished(self) -> bool:
        """Whether any request is still in flight."""

    def warm_up_step(self) -> bool:
        """While no request is in flight: do one piece of the warm-up the load deferred (the native engine captures
        one CUDA graph); False once none is left."""

    def failure(self) -> KilnError | None:
        """Why the engine can no longer serve, noticed without a step (a worker or engine process that exited
        while idle); None while it can. A health check asks it."""

    def stats_snapshot(self) -> dict:
        """Counters and latency summaries."""

    def close(self) -> None:
        """Release what the engine holds."""

    def interrupt(self) -> bool:
        """Stop a step that does not return (a hung GPU or collective) where the engine can, at the cost of the
        engine: True if it did. Only ``close`` follows."""


def is_engine_dir(path: Path) -> bool:
    """Whether ``path`` holds an engine of either backend (``engine.json`` or ``kiln_trtllm.json``)."""
    from kiln.runtime.native.engine_format import ENGINE_JSON
    from kiln.runtime.trtllm.engine_info import is_trtllm_engine

    return (Path(path) / ENGINE_JSON).is_file() or is_trtllm_engine(path)


def plan_limits(engine_dir: Path) -> EngineLimits:
    """The limits of an engine's build plan and vocabulary, read from its directory without loading it (so without
    the KV pool's size, which loading decides)."""
    from kiln.runtime.trtllm.engine_info import TrtllmEngineInfo, is_trtllm_engine

    if is_trtllm_engine(engine_dir):
        info = TrtllmEngineInfo.load(engine_dir)
        return EngineLimits.from_plan(info.plan, vocab_size=info.vocab_size)
    from kiln.runtime.native.engine_format import EngineConfig

    config = EngineConfig.load(engine_dir)
    return EngineLimits.from_plan(config.plan, vocab_size=config.architecture.vocab_size)


def engine_facts(engine_dir: Path, options: RuntimeOptions) -> dict:
    """What tells one build of an engine from another, read from its directory: its backend, the device it runs on
    with ``options``, the quantization of its weights, its KV cache dtype and tp_size."""
    from kiln.runtime.trtllm.engine_info import TrtllmEngineInfo, is_trtllm_engine

    if is_trtllm_engine(engine_dir):
        info = TrtllmEngineInfo.load(engine_dir)
        return {"backend": "trtllm", "device": options.device or "cuda", "gpu_name": info.fingerprint.get("gpu_name"),
                "quantization": info.quantization.get("format"), "kv_cache_dtype": info.plan.kv_cache_dtype,
                "tp_size": info.tp_size}
    from kiln.runtime.native.engine_format import EngineConfig
    from kiln.runtime.native.fingerprint import resolve_device

    config = EngineConfig.load(engine_dir)
    device = resolve_device(options.device, config.fingerprint)
    return {"backend": "native", "device": str(device),
            "gpu_name": config.fingerprint.get("gpu_name") if device.type == "cuda" else None,
            "quantization": config.quantization.format, "kv_cache_dtype": config.plan.kv_cache_dtype,
            "tp_size": config.tp_size}


def load_engine(engine_dir: Path, options: RuntimeOptions) -> Engine:
    """The engine of ``engine_dir`` on its backend: TensorRT-LLM for a directory with ``kiln_trtllm.json``, else the
    native engine (which refuses a directory without its ``engine.json``); in a child process of its own when
    ``options.engine_process`` is set."""
    return engine_loader(engine_dir, options)(engine_dir, options)


def engine_loader(engine_dir: Path, options: RuntimeOptions) -> Callable[[Path, RuntimeOptions], Engine]:
    """What ``load_engine`` calls for ``engine_dir``, its backend's modules imported (torch, the first time in a
    process: seconds that a load's timing leaves out)."""
    from kiln.runtime.trtllm.engine_info import is_trtllm_engine

    if options.engine_process:
        from kiln.runtime.engine_process import ProcessEngine

        return ProcessEngine.load
    if is_trtllm_engine(engine_dir):
        from kiln.runtime.trtllm.engine import TrtllmEngine

        return TrtllmEngine
    from kiln.runtime.native.engine import NativeEngine

    return NativeEngine
