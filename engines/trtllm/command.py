"""The exact argv Kiln runs: trtllm-build with every in-flight batching prerequisite spelled out, and (for
format none) the HF → TensorRT-LLM checkpoint conversion. Pure functions: nothing here runs or imports TensorRT-LLM."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from kiln.engines.cache.layout import layout_root
from kiln.engines.trtllm.options import TrtllmBuildOptions
from kiln.engines.trtllm.preflight import FP8_GEMM_PLUGIN_MAX_BATCH

BUILD_DIR_PLACEHOLDER = Path("<build-dir>")
NEW_TIMING_CACHE = "timing.cache.new"
CONVERT_MODULE = "kiln.engines.trtllm.convert"


def gemm_plugin_for(quant_format: str, max_batch_size: int) -> str:
    """NVIDIA's 1.2.x guidance: the cuBLASLt GEMM plugin in the model dtype for BF16/FP16 and for the unquantized
    GEMMs of W4A16-AWQ; none for FP8 (TensorRT's own FP8 GEMMs), except the FP8 plugin for batches of at most 4."""
    if quant_format == "fp8":
        return "fp8" if max_batch_size <= FP8_GEMM_PLUGIN_MAX_BATCH else "disable"
    return "auto"


def trtllm_build_command(checkpoint_dir: Path, output_dir: Path, options: TrtllmBuildOptions, *, quant_format: str,
                         kv_cache_dtype: str, timing_cache: Path, executable: str = "trtllm-build") -> list[str]:
    """The trtllm-build argv. The timing cache is read from `timing_cache` and written to `output_dir/
    timing.cache.new` (moved over the shared one after a successful build, so concurrent builds never tear it).
    FP8 context FMHA follows the KV cache: on for an FP8 KV cache (which preflight allows only on compute
    capability 8.9+), off otherwise."""
    gemm = options.gemm_plugin or gemm_plugin_for(quant_format, options.plan.max_batch_size)
    return [
        executable,
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(output_dir),
        "--kv_cache_type", options.kv_cache_type,
        "--remove_input_padding", _switch(options.remove_input_padding),
        "--gpt_attention_plugin", options.gpt_attention_plugin,
        "--gemm_plugin", gemm,
        "--context_fmha", _switch(options.context_fmha),
        "--use_paged_context_fmha", _switch(options.use_paged_context_fmha),
        "--use_fp8_context_fmha", _switch(kv_cache_dtype == "fp8"),
        "--tokens_per_block", str(options.plan.tokens_per_block),
        "--max_batch_size", str(options.plan.max_batch_size),
        "--max_input_len", str(options.plan.max_input_len),
        "--max_seq_len", str(options.plan.max_seq_len),
        "--max_num_tokens", str(options.plan.max_num_tokens),
        "--input_timing_cache", str(timing_cache),
        "--output_timing_cache", str(Path(output_dir) / NEW_TIMING_CACHE),
        "--workers", str(options.workers),
        "--log_level", options.log_level,
    ]


def convert_command(hf_dir: Path, output_dir: Path, options: TrtllmBuildOptions, *, dtype: str,
                    python: str = sys.executable) -> list[str]:
    """The argv converting an unquantized HF Llama checkpoint into a TensorRT-LLM checkpoint with the config's
    tensor/pipeline mapping (trtllm-build takes the mapping from the checkpoint)."""
    return [python, "-m", CONVERT_MODULE, "--model_dir", str(hf_dir), "--output_dir", str(output_dir),
            "--dtype", dtype, "--tp_size", str(options.tp_size), "--pp_size", str(options.pp_size)]


def timing_cache_path(cache_root: Path, fingerprint: dict[str, Any]) -> Path:
    """`<root>/v1/trtllm/timing-<gpu>-sm<cc>-trt<version>.cache`: TensorRT timing caches belong to one GPU model
    and one TensorRT version, so each combination keeps its own."""
    parts = (fingerprint.get("gpu_name") or "nogpu", f"sm{fingerprint.get('compute_capability') or 'na'}",
             f"trt{fingerprint.get('tensorrt') or 'na'}")
    name = "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", str(p)).strip("_") for p in parts)
    return layout_root(Path(cache_root)) / "trtllm" / f"timing-{name}.cache"


def _switch(on: bool) -> str:
    return "enable" if on else "disable"
