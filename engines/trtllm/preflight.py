"""Refuse, before a build of tens of minutes starts, what TensorRT-LLM 1.2.x would only reject at load time.

In-flight batching needs the GPT attention plugin, packed input (remove_input_padding) and a paged KV cache, or the
executor stops at load with "TrtGptModelInflightBatching requires GPT attention/Mamba Conv 1d plugin with packed
input and paged KV cache." KV block reuse and chunked context need paged context FMHA. The 1.2.x builder switches
paged context FMHA off, with a warning, for an INT8 KV cache, and for an FP8 KV cache on a checkpoint that is not
FP8-quantized; the executor, which Kiln starts with chunked context, then refuses the engine at load ("Chunked
context requires context FMHA, paged kv_cache and paged context FMHA all enabled at the same time.").
TensorRT-LLM 1.2.x supports compute capability 8.0 (Ampere) and newer; FP8 kernels need 8.9 (Ada) or newer; its
builder refuses INT4 weight-only engines (INT4-AWQ) on 10.x and 11.x ("INT8/INT4 quantization is not supported on
SM>=100."). In `kiln build`, preflight runs when the plan is made, before the quantize stage calibrates.
"""

from __future__ import annotations

from typing import Any

from kiln.engines.trtllm.options import GEMM_PLUGINS, KV_CACHE_TYPES, LOG_LEVELS, PLUGIN_DTYPES, TrtllmBuildOptions
from kiln.runtime.errors import KilnError

INFLIGHT_BATCHING_LOAD_ERROR = ("TrtGptModelInflightBatching requires GPT attention/Mamba Conv 1d plugin with packed "
                                "input and paged KV cache.")
# what the 1.2.x executor says, at load, of an engine without paged context FMHA when chunked context is on
CHUNKED_CONTEXT_LOAD_ERROR = ("Chunked context requires context FMHA, paged kv_cache and paged context FMHA all "
                              "enabled at the same time.")
# what the 1.2.x builder raises for INT4 and INT8 weight-only engines on 10.0 <= compute capability < 12.0
INT4_BUILD_ERROR = "INT8/INT4 quantization is not supported on SM>=100."
FEATURES = "build.trtllm"
MIN_COMPUTE_CAPABILITY = (8, 0)
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
INT4_REFUSED_COMPUTE_CAPABILITIES = ((10, 0), (12, 0))  # from, up to (not included)
FP8_GEMM_PLUGIN_MAX_BATCH = 4


class TrtllmPreflightError(KilnError):
    """Build options that TensorRT-LLM 1.2.x cannot build or cannot serve with in-flight batching."""


def preflight(options: TrtllmBuildOptions, quant_format: str, kv_cache_dtype: str, gpu: dict[str, Any] | None,
              checkpoint_config: dict[str, Any] | None = None) -> list[str]:
    """Check the options against TensorRT-LLM 1.2.x; raise TrtllmPreflightError listing every refusal (one line
    each), else return the warnings. `gpu` has `compute_capability` ("9.0") and `gpu_name`, or is None when no GPU
    is visible (a dry run); `checkpoint_config` is the TensorRT-LLM checkpoint's config.json when it exists."""
    errors = _value_errors(options) + _inflight_batching_errors(options)
    warnings = []
    if gpu and gpu.get("compute_capability"):
        errors += _gpu_errors(quant_format, kv_cache_dtype, gpu)
    else:
        warnings.append(_no_gpu_warning(quant_format, kv_cache_dtype))
    if kv_cache_dtype == "fp8" and quant_format != "fp8" and options.use_paged_context_fmha:
        errors.append(f"quantize.kv_cache_dtype fp8 with quantize.format {quant_format}: TensorRT-LLM 1.2.x builds "
                      f"paged context FMHA on an FP8 KV cache only for FP8-quantized checkpoints (\"FP8 Paged Context "
                      f"FMHA is disabled because FP8 context FMHA is disabled\"), and its executor then refuses the "
                      f"engine at load ({CHUNKED_CONTEXT_LOAD_ERROR!r}); use format fp8 or kv_cache_dtype auto")
    if quant_format != "none" and options.world_size > 1:
        # calibration.export writes modelopt's TensorRT-LLM checkpoint for tensor parallel 1 only: refuse here, before
        # calibration runs, rather than at the build stage after it
        errors.append(f"build.tp_size {options.tp_size} x pp_size {options.pp_size} with quantize.format "
                      f"{quant_format}: Kiln exports quantized TensorRT-LLM checkpoints for one GPU only; set tp_size "
                      f"and pp_size to 1, or use backend native (which splits FP8 and INT4-AWQ over tp_size GPUs)")
    elif checkpoint_config is not None:
        errors += _checkpoint_errors(options, checkpoint_config)
        warnings += _checkpoint_warnings(options, checkpoint_config)
    if errors:
        raise TrtllmPreflightError("\n".join(errors))
    return warnings + _limit_warnings(options, quant_format)


def _value_errors(o: TrtllmBuildOptions) -> list[str]:
    errors = []
    if o.kv_cache_type not in KV_CACHE_TYPES:
        errors.append(f"{FEATURES}.kv_cache_type {o.kv_cache_type!r} is not one of {', '.join(KV_CACHE_TYPES)}")
    for name in ("gpt_attention_plugin", "gemm_plugin"):
        value = getattr(o, name)
        allowed = GEMM_PLUGINS if name == "gemm_plugin" else PLUGIN_DTYPES
        if value is not None and value not in allowed:
            errors.append(f"{FEATURES}.{name} {value!r} is not one of {', '.join(allowed)}")
    if o.log_level not in LOG_LEVELS:
        errors.append(f"build.log_level {o.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    for name in ("tp_size", "pp_size", "workers"):  # the plan's limits were checked when it was made
        if getattr(o, name) < 1:
            errors.append(f"build.{name} ({getattr(o, name)}) must be a positive integer")
    return errors


def _inflight_batching_errors(o: TrtllmBuildOptions) -> list[str]:
    why = f"TensorRT-LLM's executor refuses such an engine at load (\"{INFLIGHT_BATCHING_LOAD_ERROR}\")"
    errors = []
    if o.kv_cache_type in KV_CACHE_TYPES and o.kv_cache_type != "paged":
        errors.append(f"{FEATURES}.kv_cache_type {o.kv_cache_type} cannot do in-flight batching, which needs a paged "
                      f"KV cache: {why}; set kv_cache_type: paged")
    if not o.remove_input_padding:
        errors.append(f"{FEATURES}.remove_input_padding false cannot do in-flight batching, which needs packed input: "
                      f"{why}; set remove_input_padding: true")
    if o.gpt_attention_plugin == "disable":
        errors.append(f"{FEATURES}.gpt_attention_plugin disable cannot do in-flight batching, which needs the GPT "
                      f"attention plugin: {why}; set gpt_attention_plugin: auto")
    if not o.context_fmha:
        errors.append(f"{FEATURES}.context_fmha false turns off paged context FMHA too, without which the engine can "
                      f"neither reuse KV blocks across requests nor chunk long prompts; set context_fmha: true")
    elif not o.use_paged_context_fmha:
        errors.append(f"{FEATURES}.use_paged_context_fmha false: the engine could neither reuse KV blocks across "
                      f"requests nor chunk long prompts (both need paged context FMHA); set use_paged_context_fmha: "
                      f"true")
    return errors


def _gpu_errors(quant_format: str, kv_cache_dtype: str, gpu: dict[str, Any]) -> list[str]:
    """What this GPU cannot build or run: below 8.0 anything, below 8.9 FP8, on 10.x and 11.x INT4-AWQ."""
    cc = tuple(int(part) for part in str(gpu["compute_capability"]).split(".")[:2])
    this = f"{gpu.get('gpu_name') or 'this GPU'} is {'.'.join(map(str, cc))}"
    if cc < MIN_COMPUTE_CAPABILITY:
        return [f"the TensorRT-LLM backend needs compute capability {_dotted(MIN_COMPUTE_CAPABILITY)} or newer (Ampere "
                f"and later, the GPUs TensorRT-LLM 1.2.x supports; BF16 needs 8.0); {this}; use backend native"]
    if (quant_format == "fp8" or kv_cache_dtype == "fp8") and cc < FP8_MIN_COMPUTE_CAPABILITY:
        return [f"FP8 (quantize.format fp8 or kv_cache_dtype fp8) needs compute capability "
                f"{_dotted(FP8_MIN_COMPUTE_CAPABILITY)} or newer (Ada, Hopper, Blackwell); {this}; use format int4_awq "
                f"or none with kv_cache_dtype auto"]
    low, high = INT4_REFUSED_COMPUTE_CAPABILITIES
    if quant_format == "int4_awq" and low <= cc < high:
        return [f"quantize.format int4_awq: TensorRT-LLM 1.2.x's builder refuses INT4 weight-only engines from "
                f"compute capability {_dotted(low)} up to {_dotted(high)} ({INT4_BUILD_ERROR!r}), which it would say "
                f"only after calibration; {this}; use format fp8 or none, or backend native"]
    return []


def _no_gpu_warning(quant_format: str, kv_cache_dtype: str) -> str:
    needs = [f"compute capability {_dotted(MIN_COMPUTE_CAPABILITY)} or newer"]
    if quant_format == "fp8" or kv_cache_dtype == "fp8":
        needs.append(f"FP8 {_dotted(FP8_MIN_COMPUTE_CAPABILITY)} or newer")
    if quant_format == "int4_awq":
        needs.append(f"INT4-AWQ a compute capability below {_dotted(INT4_REFUSED_COMPUTE_CAPABILITIES[0])} or from "
                     f"{_dotted(INT4_REFUSED_COMPUTE_CAPABILITIES[1])}")
    return f"no GPU is visible, so the GPU is not checked here: TensorRT-LLM 1.2.x needs {'; '.join(needs)}"


def _dotted(capability: tuple[int, int]) -> str:
    return ".".join(map(str, capability))


def _checkpoint_errors(o: TrtllmBuildOptions, config: dict[str, Any]) -> list[str]:
    errors = []
    mapping = config.get("mapping") or {}
    ckpt_tp, ckpt_pp = mapping.get("tp_size", 1), mapping.get("pp_size", 1)
    if (ckpt_tp, ckpt_pp) != (o.tp_size, o.pp_size):
        errors.append(f"the TensorRT-LLM checkpoint was written for tp_size {ckpt_tp}, pp_size {ckpt_pp} but "
                      f"build.tp_size is {o.tp_size} and build.pp_size {o.pp_size} (trtllm-build takes the mapping "
                      f"from the checkpoint); re-export the checkpoint or change build.tp_size/pp_size")
    kv_algo = str((config.get("quantization") or {}).get("kv_cache_quant_algo") or "").upper()
    if kv_algo == "INT8" and o.use_paged_context_fmha:
        errors.append(f"the checkpoint has an INT8 KV cache, and TensorRT-LLM 1.2.x builds it without paged context "
                      f"FMHA (\"Paged Context FMHA is disabled because it doesn't work with int8 kv cache "
                      f"currently.\"), which its executor's chunked context needs: it refuses the engine at load "
                      f"({CHUNKED_CONTEXT_LOAD_ERROR!r}); re-export the checkpoint with an FP8 or unquantized KV cache")
    return errors


def _checkpoint_warnings(o: TrtllmBuildOptions, config: dict[str, Any]) -> list[str]:
    max_positions = config.get("max_position_embeddings")
    if isinstance(max_positions, int) and o.plan.max_seq_len > max_positions:
        return [f"build.max_seq_len ({o.plan.max_seq_len}) exceeds the model's max_position_embeddings "
                f"({max_positions}); outputs past that length are not what the model was trained for"]
    return []


def _limit_warnings(o: TrtllmBuildOptions, quant_format: str) -> list[str]:
    warnings = []
    if o.plan.max_num_tokens < o.plan.max_input_len:
        warnings.append(f"build.max_num_tokens ({o.plan.max_num_tokens}) is below build.max_input_len "
                        f"({o.plan.max_input_len}): longer prompts are processed in chunks (chunked context)")
    if o.workers > o.world_size:
        warnings.append(f"build.workers ({o.workers}) is above tp_size x pp_size ({o.world_size}): the extra workers "
                        f"have no rank to build")
    if o.gemm_plugin == "fp8" and o.plan.max_batch_size > FP8_GEMM_PLUGIN_MAX_BATCH:
        warnings.append(f"{FEATURES}.gemm_plugin fp8 is NVIDIA's small-batch (<= {FP8_GEMM_PLUGIN_MAX_BATCH}) "
                        f"latency option; at max_batch_size {o.plan.max_batch_size} it may be slower than no GEMM "
                        f"plugin")
    if o.gemm_plugin == "fp8" and quant_format != "fp8":
        warnings.append(f"{FEATURES}.gemm_plugin fp8 has no effect on a {quant_format} checkpoint")
    return warnings
