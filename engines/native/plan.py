"""A build plan against what the native engine builds: the model it must hold, the KV cache dtype it resolves to, and
a KV cache that must fit in memory. (The plan's own limits are checked where it is made, ``runtime.plan``.)"""

from __future__ import annotations

from dataclasses import replace

import torch

from kiln.runtime.errors import KilnError
from kiln.runtime.native.engine_format import DTYPES, Architecture, EngineConfig
from kiln.runtime.native.kv_cache import (
    CPU_KV_MAX_BYTES,
    GPU_MEMORY_UTILIZATION,
    default_kv_blocks,
    kv_bytes_per_block,
)
from kiln.runtime.native.model.registry import family_named
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.plan import BuildPlan, PlanError

FP8_KV_NAMES = ("fp8", "float8_e4m3fn")


def fit_plan(plan: BuildPlan, arch: Architecture, dtype: str, fp8_kv_available: bool) -> BuildPlan:
    """The plan for this model: its ``max_seq_len`` within the model's positions, and ``kv_cache_dtype`` ("auto",
    "fp8" or a dtype name) resolved to the dtype the engine's KV cache has."""
    if (why := family_named(arch.type).unsupported_dtypes.get(dtype)) is not None:
        raise PlanError(f"model.dtype {dtype} cannot run {arch.type}: {why}; use bfloat16 or float32")
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


def check_kv_cache_fits(config: EngineConfig, device: str, weight_bytes: int,
                        options: RuntimeOptions | None = None) -> int:
    """How many sequences of max_seq_len the KV pool the engine will allocate on ``device`` holds at once: the
    ``num_kv_blocks`` of ``options``, else ``default_kv_blocks`` within their ``gpu_memory_utilization``, leaving room
    for ``weight_bytes`` of weights. KilnError, saying what would fit, when not even one: the engine could not load.
    Fewer than max_batch_size is a valid plan, as in TensorRT-LLM and vLLM: the scheduler admits what fits and
    preempts when the pool runs out. ``config`` is one rank's."""
    plan, options = config.plan, options or RuntimeOptions()
    share = options.gpu_memory_utilization or GPU_MEMORY_UTILIZATION
    blocks = options.num_kv_blocks or default_kv_blocks(config, torch.device(device), share, weight_bytes)
    if blocks >= plan.blocks_per_seq:
        return blocks // plan.blocks_per_seq
    block_bytes = kv_bytes_per_block(config)
    fit_len = blocks * plan.tokens_per_block
    advice = f"lower build.max_seq_len to {fit_len}" if fit_len else "free memory"
    if options.num_kv_blocks:
        pool = f"{blocks} blocks ({_gib(blocks * block_bytes)}), the num_kv_blocks given"
        advice += ", or give a larger num_kv_blocks"
    elif torch.device(device).type == "cpu":
        pool = f"{_gib(CPU_KV_MAX_BYTES)}, the most a CPU engine's pool takes"
    else:
        pool = (f"{_gib(blocks * block_bytes)}, what {device} leaves after {_gib(weight_bytes)} of weights and the "
                f"activations within gpu_memory_utilization {share}")
        advice += ", or raise gpu_memory_utilization"
    if config.plan.kv_cache_dtype != "float8_e4m3fn" and not options.num_kv_blocks:  # more blocks in the same bytes
        advice += ", or use an FP8 KV cache"
    raise KilnError(f"KV cache for one sequence of build.max_seq_len {plan.max_seq_len} needs "
                    f"{_gib(plan.blocks_per_seq * block_bytes)}, but the engine's KV pool holds {pool}: {advice}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
