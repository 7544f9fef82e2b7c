"""What ``kiln bench`` measures: a config's engine, or an architecture file instantiated with random weights.

An architecture file (a Hugging Face ``config.json``, e.g. ``configs/models/llama3-8b.json``) becomes a seeded
random-weight bf16 checkpoint with a byte-level tokenizer over its whole vocabulary, made once and kept in the engine
cache's ``checkpoints`` store; then a config (built from the config model, written under ``<cache root>/bench/``)
whose build plan fits the run takes it through the pipeline like any other. ``--format fp8`` / ``int4_awq`` quantize
it in the quantize stage, on random token ids (``quantize.dataset: random``) in one round and without the accuracy
gate (there is no accuracy to keep in random weights), and the output says so.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from kiln.calibration.recipe import QuantizeRecipe
from kiln.calibration.sources import RANDOM
from kiln.engines.cache.layout import write_atomic
from kiln.engines.native.checkpoint import parse_architecture
from kiln.pipeline.config import BuildSection, CacheSection, KilnConfig, ModelSection, cache_root, load_config
from kiln.runtime.errors import KilnError
from kiln.runtime.native.model.registry import family_of
from kiln.runtime.native.parallel.sharding import sharding_problems

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCH_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "max_position_embeddings")
CPU_MAX_PARAMS = 2 * 10**9  # above this a CPU-only machine is refused without --allow-large
CALIB_SAMPLES, CALIB_LEN, HELDOUT_SAMPLES = 16, 128, 4  # the random token rows that calibrate a quantized checkpoint
MAX_BENCH_BATCH = 512  # the generated plan's default max_batch_size: all --prompts in flight, up to this
MAX_NUM_TOKENS = 8192  # the generated plan's token budget per step (at least --input-len)
BLOCK = 32  # tokens per KV block: the decode attention kernel is ~1.5x slower over 16-token blocks on an H200


BENCH_TAKES = ("kiln bench builds what it measures from a config or an architecture file (and its peer needs the "
               "checkpoint): give the config the engine was built from, or measure the built engine served with "
               "`kiln loadtest`")


class BenchTargetError(KilnError):
    """A TARGET that is neither a config nor an architecture file, or one this machine cannot benchmark."""


@dataclass(frozen=True)
class BenchPlan:
    """The run's sizes, which a generated config's build plan must hold, and the most sequences it runs at once
    (None: ``MAX_BENCH_BATCH``; only an architecture file's generated plan takes it)."""

    prompts: int
    input_len: int
    output_len: int
    max_batch_size: int | None = None


def read_architecture_file(path: Path) -> dict:
    """The architecture file's config.json dict (``_comment`` keys dropped), checked for what the weights need and
    for what the native engine runs, so that either is refused naming the file before random weights are written."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BenchTargetError(f"{path}: not a readable JSON architecture file ({e})") from None
    if not isinstance(data, dict) or not data.get("architectures"):
        raise BenchTargetError(f"{path}: no 'architectures' entry; an architecture file is a Hugging Face config.json "
                               f"(e.g. configs/models/llama3-8b.json)")
    missing = [key for key in ARCH_REQUIRED if not isinstance(data.get(key), int) or data[key] <= 0]
    if missing:
        raise BenchTargetError(f"{path}: {', '.join(missing)} must be positive integers; copy the model's config.json")
    cfg = {k: v for k, v in data.items() if not k.startswith("_")}
    _check_architecture(path, cfg)
    return cfg


def _check_architecture(path: Path, cfg: dict) -> None:
    """Refuse, naming ``path``, an architecture the native engine does not run (its family, or a field the build
    would refuse), a ``model_type`` that is not its family's, or one transformers cannot make the weights of."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers.utils import logging as hf_logging

    family = family_of(cfg, path)
    if cfg.get("model_type") != family.name:
        given = repr(cfg["model_type"]) if "model_type" in cfg else "no model_type entry"
        raise BenchTargetError(f"{path}: model_type must be {family.name!r} for {cfg['architectures'][0]}, got "
                               f"{given}; copy the model's config.json")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warnings (an eos_token_id outside the vocabulary) repeat what is refused
    try:
        _transformers_config(cfg)
    except (TypeError, ValueError, KeyError, StrictDataclassError) as e:
        # a validation error's last line is its reason, after the name of the error it wraps
        reason = re.sub(r"^\w+Error: ", "", str(e).strip().splitlines()[-1].strip()).rstrip(".")
        raise BenchTargetError(f"{path}: transformers cannot make weights of this architecture: {reason}; fix the "
                               f"file") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    try:
        parse_architecture(cfg, {}, path)
    except (TypeError, ValueError, KeyError) as e:  # a bad value that parse_architecture does not name itself
        raise BenchTargetError(f"{path}: a field has the wrong type or value ({e}); fix the file") from None


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face checkpoint of this architecture, with its shape: the parameters of
    transformers' model for it, instantiated on the meta device (no memory), so every family's own tensors (biases,
    per-head norms) are there."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_transformers_config(cfg))
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def _transformers_config(cfg: dict) -> PretrainedConfig:
    """transformers' config of the architecture (its class validates the fields)."""
    from transformers import AutoConfig

    fields = {key: value for key, value in cfg.items() if key != "model_type" and not key.startswith("_")}
    return AutoConfig.for_model(cfg["model_type"], **fields)


def is_decoder_linear(name: str, shape: tuple[int, ...]) -> bool:
    """A decoder layer's linear weight: what modelopt quantizes (not norms, biases, embeddings or the LM head)."""
    return name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2


def param_count(cfg: dict) -> int:
    """Parameters of the architecture."""
    return sum(math.prod(shape) for shape in weight_shapes(cfg).values())


def check_fits_machine(path: Path, cfg: dict, *, cuda: bool, allow_large: bool, fp8: bool = False) -> None:
    """Refuse a large architecture on a CPU-only machine unless ``--allow-large``; ``fp8``: its random checkpoint
    holds the decoder linears in FP8 (``--random-quantized``), the rest in bf16."""
    shapes = weight_shapes(cfg)
    params = sum(math.prod(shape) for shape in shapes.values())
    if cuda or allow_large or params <= CPU_MAX_PARAMS:
        return
    nbytes = sum(math.prod(shape) * (1 if fp8 and is_decoder_linear(name, shape) else 2)
                 for name, shape in shapes.items())
    raise BenchTargetError(f"{path}: {params / 1e9:.1f}B parameters is too big to benchmark on this CPU-only machine "
                           f"({nbytes / 1e9:.0f} GB of random {'FP8' if fp8 else 'bf16'} weights, minutes per decoded "
                           f"token); run it on a GPU, or pass --allow-large to try anyway")


def bench_root() -> Path:
    """Where generated configs live: ``<cache root>/bench`` ($KILN_CACHE or ~/.cache/kiln)."""
    return cache_root() / "bench"


def bench_config(checkpoint_dir: Path, plan: BenchPlan, cfg: dict, *, fmt: str, kv_cache_dtype: str,
                 seed: int, tp_size: int = 1) -> KilnConfig:
    """The config that builds ``checkpoint_dir`` for the run: a build plan that holds it (over ``tp_size`` ranks)
    and, for a quantized ``fmt``, calibration on random token ids in one round without the accuracy gate. Called
    first with the architecture file as ``checkpoint_dir``, so that what the plan cannot hold is refused, naming the
    file and the option, before its random weights are written."""
    seq_len, positions = plan.input_len + plan.output_len, cfg["max_position_embeddings"]
    if seq_len > positions:  # the request's own length: only the KV pool is counted in whole blocks
        raise BenchTargetError(f"--input-len {plan.input_len} + --output-len {plan.output_len} exceeds the "
                               f"architecture's max_position_embeddings ({positions}); shorten them")
    max_seq_len = min(-(-seq_len // BLOCK) * BLOCK, positions)  # whole blocks, within the model's positions
    quantize = QuantizeRecipe(format=fmt)
    if fmt != "none":
        quantize = QuantizeRecipe(format=fmt, kv_cache_dtype=kv_cache_dtype, dataset=RANDOM, heldout=RANDOM,
                                  num_samples=CALIB_SAMPLES, round_samples=CALIB_SAMPLES,
                                  heldout_samples=HELDOUT_SAMPLES, seq_len=CALIB_LEN, seed=seed, on_failure="warn",
                                  gate=None)
    if tp_size > 1 and (problems := sharding_problems(parse_architecture(cfg, {}, checkpoint_dir), tp_size,
                                                      quantize.int4_group_size)):
        raise BenchTargetError(f"{checkpoint_dir}: --tp-size {tp_size} cannot split this architecture: "
                               f"{'; '.join(problems)}; choose a --tp-size that divides them")
    batch = min(plan.prompts, plan.max_batch_size or MAX_BENCH_BATCH)
    build = BuildSection(backend="native", max_batch_size=batch, max_input_len=plan.input_len, max_seq_len=max_seq_len,
                         max_num_tokens=max(plan.input_len, batch, min(MAX_NUM_TOKENS, plan.prompts * plan.input_len)),
                         tokens_per_block=BLOCK, tp_size=tp_size)
    return KilnConfig(model=ModelSection(path=str(checkpoint_dir), dtype="bfloat16"), quantize=quantize,
                      build=build, cache=CacheSection(dir=str(cache_root())))


def write_config(config: KilnConfig, note: str) -> Path:
    """Write a generated config under ``bench_root()`` (named by its content, written once) and return its path."""
    text = f"# Generated by kiln bench: {note}.\n" + yaml.safe_dump(
        config.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
    path = bench_root() / f"bench-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text.encode())
    return path


def check_config_holds(config_path: Path, plan: BenchPlan) -> None:
    """A config's build plan must take prompts of ``--input-len`` plus ``--output-len`` new tokens."""
    build = load_config(config_path).config.build
    if plan.input_len > build.max_input_len:
        raise BenchTargetError(f"{config_path}: --input-len {plan.input_len} exceeds build.max_input_len "
                               f"({build.max_input_len}); shorten --input-len or raise the config's limit")
    if plan.input_len + plan.output_len > build.max_seq_len:
        raise BenchTargetError(f"{config_path}: --input-len {plan.input_len} + --output-len {plan.output_len} exceeds "
                               f"build.max_seq_len ({build.max_seq_len}); shorten them or raise the config's limit")

