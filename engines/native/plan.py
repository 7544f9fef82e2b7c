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
from kiln.runtime.plan import BuildPlan

FP8_KV_NAMES = ("fp8", "float8_e4m3fn")
KV_MEMORY_FRACTION = {"cuda": 0.9, "cpu": 0.5}  # of free GPU memory / of MemAvailable, before subtracting weights


def fit_plan(plan: BuildPlan, arch: Architecture, dtype: str, fp8_kv_available: bool) -> BuildPlan:
    """The plan for this model: its ``max_seq_len`` within the model's positions, and ``kv_cache_dtype`` ("auto",
    "fp8" or a dtype name) resolved to the dtype the engine's KV cache has."""
    if plan.max_seq_len > arch.max_position_embeddings:
        raise KilnError(f"build.max_seq_len ({plan.max_seq_len}) exceeds the model's max_position_embeddings "
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


def check_kv_cache_fits(config: EngineConfig, device: str, weight_bytes: int, ranks: int = 1) -> None:
    """Raise KilnError when max_batch_size sequences of max_seq_len tokens do not fit, saying what would. ``config``
    is one rank's; ``ranks`` of them share ``device``'s memory (the weights of all of them are ``weight_bytes``)."""
    plan = config.plan
    block_bytes = ranks * kv_bytes_per_block(config)
    blocks_per_seq = plan.blocks_per_seq
    need = plan.max_batch_size * blocks_per_seq * block_bytes
    budget = memory_budget_bytes(device, weight_bytes)
    if need <= budget:
        return
    fit_seqs = max(budget, 0) // (blocks_per_seq * block_bytes)
    fit_len = max(budget, 0) // (plan.max_batch_size * block_bytes) * plan.tokens_per_block
    advice = f"lower build.max_batch_size to {fit_seqs}" if fit_seqs else "free memory"
    if fit_len:
        advice += f" or build.max_seq_len to {fit_len}"
    if config.plan.kv_cache_dtype != "float8_e4m3fn":
        advice += ", or use an FP8 KV cache"
    raise KilnError(
        f"KV cache for build.max_batch_size {plan.max_batch_size} x build.max_seq_len {plan.max_seq_len} needs "
        f"{_gib(need)} but {_gib(max(budget, 0))} is available on {device} after {_gib(weight_bytes)} of weights: "
        f"{fit_seqs} sequence(s) of {plan.max_seq_len} tokens fit; {advice}"
    )


def _mem_available() -> int:
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
