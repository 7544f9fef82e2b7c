"""Build a native engine directory from a Hugging Face checkpoint of a supported family (plain or modelopt FP8 /
INT4-AWQ)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from kiln.engines.cache.manifest import new_file_mode
from kiln.engines.native.checkpoint import CheckpointTensors, read_architecture, read_quantization
from kiln.engines.native.plan import check_kv_cache_fits, fit_plan
from kiln.engines.native.tuning import fp8_kernels_measurable, measure_fp8_streaming_max_m
from kiln.engines.native.weights import convert_weights
from kiln.runtime.errors import KilnError
from kiln.runtime.native.engine_format import (
    DTYPES,
    ENGINE_FORMAT,
    Architecture,
    EngineConfig,
    QuantizationConfig,
    weights_file,
)
from kiln.runtime.native.fingerprint import machine_fingerprint
from kiln.runtime.native.model.decoder import DecoderModel
from kiln.runtime.native.parallel.sharding import rank_architecture, rank_config, shard_weights, sharding_problems
from kiln.runtime.native.weight_loading import weights_mismatch
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.plan import BuildPlan, PlanError
from kiln.runtime.tokenizer import Tokenizer
from kiln.runtime.tokenizer_files import copy_tokenizer_files

# The files transformers makes a tokenizer.json from, where a checkpoint has none: the builder copies none of them,
# and its caller writes the engine's tokenizer.json (the build stage: ``pipeline.tokenizer_files``)
CONVERTIBLE_TOKENIZERS = (("vocab.json", "merges.txt"), ("tokenizer.model",))


def build_native_engine(checkpoint_dir: Path, out_dir: Path, plan: BuildPlan, dtype: str, device: str = "cpu",
                        options: RuntimeOptions | None = None, tp_size: int = 1,
                        tokenizer_dir: Path | None = None) -> dict:
    """Convert an HF checkpoint (plain, or modelopt's unified FP8 / W4A16_AWQ export, detected from
    hf_quant_config.json / config.json quantization_config) into an engine dir at out_dir (which exists, empty),
    split over ``tp_size`` tensor-parallel ranks (one weight file each, ``runtime.native.parallel.sharding``).
    Validates the plan against the KV pool that ``options`` (``num_kv_blocks``, ``gpu_memory_utilization``) give the
    engine: at least one sequence of max_seq_len must fit, else it says which max_seq_len would. On CUDA with the
    Triton ``options.kernels``, times each FP8 linear's crossover (``tuning``; key material:
    ``tuning_material``). A checkpoint whose tokenizer is CONVERTIBLE_TOKENIZERS' files, not tokenizer.json, is
    built without one: the caller writes it. The tokenizer, chat templates and generation config (its EOS ids too)
    come from ``tokenizer_dir`` (the model folder a quantized checkpoint was calibrated from), else from
    ``checkpoint_dir``. Returns the engine.json dict."""
    checkpoint_dir, out_dir, options = Path(checkpoint_dir), Path(out_dir), options or RuntimeOptions()
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else checkpoint_dir
    if not out_dir.is_dir():
        raise KilnError(f"engine output directory {out_dir} does not exist; create it (empty) first")
    if dtype not in DTYPES:
        raise KilnError(f"build dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if torch.device(device).type not in ("cpu", "cuda"):
        raise KilnError(f"build device {device!r} is not supported by the native backend; use cpu or cuda")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise KilnError(f"build device {device!r} requested but CUDA is not available on this machine")
    arch, hf_config = read_architecture(checkpoint_dir, tokenizer_dir)
    source_quant = read_quantization(checkpoint_dir, hf_config)
    refuse_unshardable(arch, tp_size, source_quant.group_size)
    build_plan = fit_plan(plan, arch, dtype, source_quant.fp8_kv_cache)
    # the tokenizer is loaded once here, so that a broken one is never published
    if Tokenizer.from_dir(tokenizer_dir) is None and not _convertible_tokenizer(tokenizer_dir):
        raise KilnError(f"{tokenizer_dir}: no tokenizer.json (nor vocab.json + merges.txt or tokenizer.model to make "
                        "one from); the native runtime needs a fast tokenizer file (save the tokenizer with "
                        "save_pretrained)")

    fp8_kv_cache = build_plan.kv_cache_dtype == "float8_e4m3fn"
    weights, dense_modules = convert_weights(CheckpointTensors(checkpoint_dir), arch, source_quant.format,
                                             source_quant.group_size, DTYPES[dtype], fp8_kv_cache)
    if arch.tie_word_embeddings and "lm_head.weight" in weights:  # the checkpoint's own head, unlike the embedding
        arch = replace(arch, tie_word_embeddings=False)
    config = EngineConfig(
        architecture=arch,
        dtype=dtype,
        quantization=QuantizationConfig(
            format=source_quant.format,
            group_size=source_quant.group_size,
            kv_cache_dtype=build_plan.kv_cache_dtype,
            exclude_modules=dense_modules,
        ),
        plan=build_plan,
        fingerprint=machine_fingerprint(device),
        tp_size=tp_size,
    )
    check_weights_match(config, weights, checkpoint_dir)
    shards = shard_weights(weights, arch, tp_size) if tp_size > 1 else [weights]
    check_kv_cache_fits(rank_config(config), device, max(_bytes(shard) for shard in shards), options)
    if source_quant.format == "fp8" and fp8_kernels_measurable(device, options.kernels):  # the plan is known to fit
        streaming_max_m = measure_fp8_streaming_max_m(rank_architecture(arch, tp_size), DTYPES[dtype], device)
        config = replace(config, quantization=replace(config.quantization, fp8_streaming_max_m=streaming_max_m))

    for rank, shard in enumerate(shards):
        path = out_dir / weights_file(rank)
        save_file({name: t.contiguous() for name, t in shard.items()}, str(path), metadata={"format": ENGINE_FORMAT})
        path.chmod(new_file_mode())  # safetensors writes 0600: others could not load an engine built for them
    copy_tokenizer_files(tokenizer_dir, out_dir)
    config.save(out_dir)
    return config.to_dict()


def _convertible_tokenizer(checkpoint_dir: Path) -> bool:
    return any(all((checkpoint_dir / name).is_file() for name in names) for names in CONVERTIBLE_TOKENIZERS)


def check_weights_match(config: EngineConfig, weights: dict[str, torch.Tensor], checkpoint_dir: Path) -> None:
    """Refuse converted ``weights`` that the model of ``config`` cannot load (checked on the meta device, no
    memory): a checkpoint whose tensors disagree with its config.json is refused before anything is written,
    where it would otherwise reach the cache and fail at every load."""
    with torch.device("meta"):
        params = DecoderModel(replace(config, tp_size=1), config.torch_dtype).state_dict()
    if problem := weights_mismatch({name: tuple(t.shape) for name, t in weights.items()}, params):
        raise KilnError(f"{checkpoint_dir}: the checkpoint's tensors do not match its config.json (runtime layout: "
                        f"{problem}); check config.json's sizes against the weights, or re-export the checkpoint")


def _bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def refuse_parallelism(pp_size: int) -> None:
    """The native backend splits a model over GPUs by tensor parallelism only: a pipeline-parallel plan is refused,
    not built as something else."""
    if pp_size != 1:
        raise PlanError(f"build.pp_size {pp_size}: the native backend has no pipeline parallelism; set it to 1 and "
                        f"split the model with build.tp_size instead, or use backend trtllm")


def refuse_unshardable(arch: Architecture, tp_size: int, group_size: int | None) -> None:
    """A model that ``tp_size`` ranks cannot split evenly is refused, naming each shape that does not divide."""
    if problems := sharding_problems(arch, tp_size, group_size):
        raise PlanError(f"build.tp_size {tp_size} cannot split this model: {'; '.join(problems)}; choose a tp_size "
                        f"that divides them")


def preflight_tensor_parallel(checkpoint_dir: Path, tp_size: int) -> None:
    """Refuse a ``tp_size`` that cannot split the checkpoint's heads, KV heads or MLP evenly, whichever backend
    builds it (TensorRT-LLM's conversion splits them as the native sharding does); reads config.json only. A
    checkpoint the native reader does not take is left to the backend that builds it."""
    if tp_size == 1:
        return
    try:
        arch = read_architecture(Path(checkpoint_dir))[0]
    except KilnError:  # a family or a field the native engine refuses, which TensorRT-LLM may take
        return
    refuse_unshardable(arch, tp_size, None)


def preflight_native_plan(checkpoint_dir: Path, plan: BuildPlan, dtype: str, tp_size: int = 1,
                          quantized_group_size: int | None = None, formats: Sequence[str] = ("none",)) -> None:
    """Check a build plan against the checkpoint's architecture before any stage runs (reads config.json only), so
    a plan the model cannot hold fails in seconds rather than after calibration; ``quantized_group_size``: the INT4
    group size of the checkpoint the quantize stage may make of it, whose groups the ranks must not split, and
    which every linear's input features must hold whole when ``formats`` (the primary format, then the fallback
    chain) has int4_awq."""
    arch, hf_config = read_architecture(Path(checkpoint_dir))
    fit_plan(replace(plan, kv_cache_dtype="auto"), arch, dtype, fp8_kv_available=False)
    source_group_size = read_quantization(Path(checkpoint_dir), hf_config).group_size
    refuse_unshardable(arch, tp_size, source_group_size or quantized_group_size)
    if "int4_awq" in formats and quantized_group_size:
        refuse_partial_groups(arch, quantized_group_size, primary=formats[0] == "int4_awq")


def refuse_partial_groups(arch: Architecture, group_size: int, primary: bool = True) -> None:
    """An int4_awq plan whose linears' input features are not whole INT4 groups is refused, naming them; one where
    int4_awq is a fallback too, before the primary format's calibration is spent (``primary``: it is the first)."""
    inputs = {"hidden_size (q/k/v, gate/up input)": arch.hidden_size,
              "num_attention_heads x head_dim (o_proj input)": arch.num_heads * arch.head_dim,
              "intermediate_size (down_proj input)": arch.intermediate_size}
    if bad := [f"{name} {features}" for name, features in inputs.items() if features % group_size]:
        fix = ("make fp8 the primary format (quantize.format: fp8: the fallback chain applies to the gate)" if primary
               else "remove int4_awq from quantize.fallback")
        raise PlanError(f"int4_awq needs in-features divisible by {group_size}, but {'; '.join(bad)} are not; {fix}")
