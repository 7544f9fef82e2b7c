"""A build plan against what the native engine builds: the model it must hold, the KV cache dtype it resolves to, and
a KV cache that must fit in memory. (The plan's own limits are checked where it is made, ``runtime.plan``.)"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from kiln.runtime.errors import KilnError
from kiln.runtime.native.engine_format import DTYPES, Architecture, EngineConfig
from kiln.runtime.native.kv_cache import kv_bytes_per_block
from kiln.runtime.plan import BuildPlan, PlanError

FP8_KV_NAMES = ("fp8", "float8_e4m3fn")
KV_MEMORY_FRACTION = {"cuda": 0.9, "cpu": 0.5}  # of free GPU memory / of MemAvailable, before subtracting weights


def fit_plan(plan: BuildPlan, arch: Architecture, dtype: str, fp8_kv_available: bool) -> BuildPlan:
    """The plan for this model: its ``max_seq_len`` within the model's positions, and ``kv_cache_dtype`` ("auto",
    "fp8" or a dtype name) resolved to the dtype the engine's KV cache has."""
    if plan.max_seq_len > arch.max_position_embeddings:
        raise PlanError(f"build.max_seq_len ({plan.max_seq_len}) exceeds the model's max_position_embeddings "
                        f"({arch.max_position_embeddings}); lower build.max_seq_len")
    return replace(plan, kv_cache_dtype=_kv_cache_dtype(plan.kv_cache_dtype, dtype, fp8_kv_available))


def _kv_cache_dtype(requested: str, dtype: str, fp8_kv_available: bool) -> str:
    if requested == "auto":
        return "float8_e4m3fn" if fp8_kv_available else dtype
    if requested in FP8_KV_NAMES:
        if not fp8_kv_available:
            raise KilnError("build.kv_cache_dtype fp8 needs a checkpoint with FP8 KV cache scales (k_scale/v_scale); "
                            "quantize with an FP8 KV cache, or use kv_cache_dtype auto")
        return "float8_e4m3fn"
    if requested in DTYPES:
        return requested
    raise KilnError(f"build.kv_cache_dtype {requested!r} is not one of auto, fp8, {', '.join(DTYPES)}")


def memory_budget_bytes(device: str, weight_bytes: int) -> int:
    """Bytes the KV cache may take on ``device``: a fraction of free memory, minus the weights."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
    else:
        free = _mem_available()
    return int(free * KV_MEMORY_FRACTION[dev.type]) - weight_bytes


def check_kv_cache_fits(config: EngineConfig, device: str, weight_bytes: int, ranks: int = 1) -> int:
    """How many sequences of max_seq_len the KV cache can hold at once on ``device``; KilnError, saying what would
    fit, when not even one can. Fewer than max_batch_size is a valid plan, as in TensorRT-LLM and vLLM: the
    scheduler admits what fits and preempts when the pool runs out. ``config`` is one rank's; ``ranks`` of them
    share ``device``'s memory (the weights of all of them are ``weight_bytes``)."""
    plan = config.plan
    block_bytes = ranks * kv_bytes_per_block(config)
    seq_bytes = plan.blocks_per_seq * block_bytes
    budget = max(memory_budget_bytes(device, weight_bytes), 0)
    if budget >= seq_bytes:
        return budget // seq_bytes
    fit_len = budget // block_bytes * plan.tokens_per_block
    advice = f"lower build.max_seq_len to {fit_len}" if fit_len else "free memory"
    if config.plan.kv_cache_dtype != "float8_e4m3fn":
        advice += ", or use an FP8 KV cache"
    raise KilnError(f"KV cache for one sequence of build.max_seq_len {plan.max_seq_len} needs {_gib(seq_bytes)} but "
                    f"{_gib(budget)} is available on {device} after {_gib(weight_bytes)} of weights: {advice}")


def _mem_available() -> int:
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
