"""What ``kiln bench`` measures: a config's engine, or an architecture file instantiated with random weights.

An architecture file (a Hugging Face ``config.json``, e.g. ``configs/models/llama3-8b.json``) becomes a seeded
random-weight bf16 checkpoint under ``<cache root>/bench/`` (written once, to a temporary folder, then renamed), with
a word-level tokenizer over its whole vocabulary, and a generated config whose build plan fits the run. ``--format
fp8`` / ``int4_awq`` quantize that checkpoint with modelopt (FP8 max calibration, INT4 AWQ-lite) on a few batches of
random token ids: no convergence rounds and no accuracy gate (there is no accuracy to keep in random weights), and
the output says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.engines.cache.layout import write_atomic
from kiln.pipeline.bench.common import free_memory
from kiln.pipeline.config import CONFIGS_DIR, CacheSection, load_config
from kiln.runtime.errors import KilnError

ARCH_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "max_position_embeddings")
CPU_MAX_PARAMS = 2 * 10**9  # above this a CPU-only machine is refused without --allow-large
SHARD_BYTES = 2 * 10**9
CHECKPOINT_VERSION = 1  # bump when the random checkpoint's bytes change for the same inputs
CALIB_BATCHES, CALIB_ROWS, CALIB_LEN = 4, 4, 128  # the random token batches that calibrate a quantized checkpoint
CALIB_METHODS = {"fp8": "max", "int4_awq": "awq_lite"}  # modelopt's algorithm per format
MAX_BENCH_BATCH = 512  # the generated plan's max_batch_size: all --prompts in flight, up to this
MAX_NUM_TOKENS = 8192  # the generated plan's token budget per step (at least --input-len)
BLOCK = 32  # tokens per KV block: the decode attention kernel is ~1.5x slower over 16-token blocks on an H200

Progress = Callable[[str], None]


class BenchTargetError(KilnError):
    """A TARGET that is neither a config nor an architecture file, or one this machine cannot benchmark."""


@dataclass(frozen=True)
class Target:
    """A resolved TARGET: ``kind`` is "config" or "architecture"."""

    kind: str
    path: Path


@dataclass(frozen=True)
class BenchPlan:
    """The run's sizes, which a generated config's build plan must hold."""

    prompts: int
    input_len: int
    output_len: int


def resolve_target(target: str) -> Target:
    """A path as given, or a bare name under configs/ or configs/models/ (with or without .yaml / .json)."""
    path = Path(target).expanduser()
    candidates = [path]
    if path.parent == Path("."):
        candidates += [d / f"{path.name}{suffix}" for d in (CONFIGS_DIR, CONFIGS_DIR / "models")
                       for suffix in ("", ".yaml", ".yml", ".json")]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise BenchTargetError(f"{target}: no such config or architecture file; give a config (a path or a name under "
                               f"configs/, e.g. tiny-llama-bf16.yaml) or an architecture file "
                               f"(configs/models/llama3-8b.json)")
    if found.suffix in (".yaml", ".yml"):
        return Target("config", found.resolve())
    if found.suffix == ".json":
        return Target("architecture", found.resolve())
    raise BenchTargetError(f"{found}: neither a config (.yaml) nor an architecture file (.json); give one of those")


def read_architecture_file(path: Path) -> dict:
    """The architecture file's config.json dict (``_comment`` keys dropped), checked for what the weights need."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BenchTargetError(f"{path}: not a readable JSON architecture file ({e})") from None
    if not isinstance(data, dict) or not data.get("architectures"):
        raise BenchTargetError(f"{path}: no 'architectures' entry; an architecture file is a Hugging Face config.json "
                               f"(e.g. configs/models/llama3-8b.json)")
    missing = [key for key in ARCH_REQUIRED if not isinstance(data.get(key), int) or data[key] <= 0]
    if missing:
        raise BenchTargetError(f"{path}: {', '.join(missing)} must be positive integers; copy the model's config.json")
    return {k: v for k, v in data.items() if not k.startswith("_")}


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Llama checkpoint of this architecture, with its shape."""
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden), f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def param_count(cfg: dict) -> int:
    """Parameters of the architecture."""
    return sum(_numel(shape) for shape in weight_shapes(cfg).values())


def check_fits_machine(path: Path, cfg: dict, *, cuda: bool, allow_large: bool) -> None:
    """Refuse a large architecture on a CPU-only machine unless ``--allow-large``."""
    params = param_count(cfg)
    if cuda or allow_large or params <= CPU_MAX_PARAMS:
        return
    raise BenchTargetError(f"{path}: {params / 1e9:.1f}B parameters is too big to benchmark on this CPU-only machine "
                           f"({2 * params / 1e9:.0f} GB of random bf16 weights, minutes per decoded token); run it on "
                           f"a GPU, or pass --allow-large to try anyway")


def bench_root() -> Path:
    """Where random checkpoints and generated configs live: ``<cache root>/bench`` ($KILN_CACHE or ~/.cache/kiln)."""
    return CacheSection().root() / "bench"


def random_checkpoint(arch_path: Path, cfg: dict, *, seed: int, device: str, progress: Progress) -> Path:
    """The seeded random-weight bf16 checkpoint of ``cfg`` (made once per architecture, seed and device)."""
    material = {"architecture": cfg, "seed": seed, "dtype": "bfloat16", "generator": torch.device(device).type,
                "version": CHECKPOINT_VERSION}
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]
    final = bench_root() / "checkpoints" / f"{arch_path.stem}-seed{seed}-{digest}" / "hf"
    if (final / "config.json").is_file():
        return final
    progress(f"writing random-weight checkpoint ({_human_params(param_count(cfg))} parameters, seed {seed}) to "
             f"{final}")
    with _publishing(final) as tmp:
        _write_random_weights(tmp, cfg, seed, device)
        (tmp / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}, indent=2, sort_keys=True) + "\n")
        _write_word_level_tokenizer(tmp, cfg)
    return final


def quantized_checkpoint(hf_dir: Path, fmt: str, *, device: str, seed: int, progress: Progress,
                         kv_cache_dtype: str = "auto") -> Path:
    """``hf_dir`` quantized to ``fmt`` (fp8 or int4_awq) by modelopt over random token batches, next to it; with
    ``kv_cache_dtype`` fp8 the KV cache is calibrated to FP8 too."""
    method = CALIB_METHODS[fmt]
    kv = "-kvfp8" if kv_cache_dtype == "fp8" else ""
    final = hf_dir.parent / f"{fmt.replace('_', '-')}-{method.replace('_', '-')}-random{CALIB_BATCHES}x{CALIB_ROWS}" \
        f"x{CALIB_LEN}{kv}"
    if (final / "hf_quant_config.json").is_file():
        return final
    progress(f"quantizing to {fmt} with modelopt ({method} on {CALIB_BATCHES} random token batches)")
    from transformers import AutoModelForCausalLM

    from kiln.calibration.export import export_hf
    from kiln.calibration.modelopt_quantize import mtq, quant_config, quiet

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [torch.randint(0, vocab, (CALIB_ROWS, CALIB_LEN), generator=generator) for _ in range(CALIB_BATCHES)]

    def forward_loop(m) -> None:
        with torch.no_grad():
            for batch in batches:
                m(input_ids=batch.to(device))

    with _publishing(final) as tmp, quiet([]):
        tmp.rmdir()  # modelopt's exporter creates it
        mtq.quantize(model, quant_config(fmt, method, kv_cache_dtype), forward_loop)
        export_hf(model, hf_dir, tmp, torch.bfloat16)
    del model
    free_memory(device)  # the quantized copy leaves the GPU before the engine is built and loaded
    return final


def bench_config(checkpoint_dir: Path, plan: BenchPlan, cfg: dict, note: str) -> Path:
    """A generated config for ``checkpoint_dir`` whose build plan holds the run (format none: the checkpoint is
    built as it is, quantized or not)."""
    max_seq_len = -(-(plan.input_len + plan.output_len) // BLOCK) * BLOCK
    if max_seq_len > cfg["max_position_embeddings"]:
        raise BenchTargetError(f"--input-len {plan.input_len} + --output-len {plan.output_len} exceeds the "
                               f"architecture's max_position_embeddings ({cfg['max_position_embeddings']}); "
                               "shorten them")
    max_num_tokens = max(plan.input_len, min(MAX_NUM_TOKENS, plan.prompts * plan.input_len))
    build = {"max_batch_size": min(plan.prompts, MAX_BENCH_BATCH), "max_input_len": plan.input_len,
             "max_seq_len": max_seq_len, "max_num_tokens": max_num_tokens, "tokens_per_block": BLOCK}
    text = "\n".join([
        f"# Generated by kiln bench: {note}.",
        "model:", f"  path: {json.dumps(str(checkpoint_dir))}", "  dtype: bfloat16",
        "quantize:", "  format: none",
        "build:", "  backend: native", *(f"  {k}: {v}" for k, v in build.items()),
        "cache:", f"  dir: {json.dumps(str(bench_root().parent))}", "",
    ])
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = checkpoint_dir.parent / f"bench-{checkpoint_dir.name}-{digest}.yaml"
    if not path.is_file():
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


@contextmanager
def _publishing(final: Path) -> Iterator[Path]:
    """Yield a temporary folder next to ``final``; rename it into place when the block succeeds."""
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if not tmp.is_dir():
            raise RuntimeError(f"{tmp} vanished before publishing")
        try:
            os.rename(tmp, final)
        except OSError:  # another run published it first: theirs is the same bytes
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_random_weights(out: Path, cfg: dict, seed: int, device: str) -> None:
    """Linears N(0, initializer_range), norms 1, in bf16 safetensors shards of about 2 GB, with an index."""
    from safetensors.torch import save_file

    std = float(cfg.get("initializer_range", 0.02))
    shapes = weight_shapes(cfg)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _random_tensor(shapes[name], name, seed, std, device) for name in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    index = {"metadata": {"total_size": sum(2 * _numel(s) for s in shapes.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _random_tensor(shape: tuple[int, ...], name: str, seed: int, std: float, device: str) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    tensor_seed = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")
    generator = torch.Generator(device=device).manual_seed(tensor_seed)
    values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return (values * std).to(torch.bfloat16).cpu()


def _write_word_level_tokenizer(out: Path, cfg: dict) -> None:
    """Tokens ``t0 .. t{vocab-1}``: the engine is driven with token ids, and this keeps decoding total."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = cfg["vocab_size"]
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "unk_token": "t0"}) + "\n")


def _human_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.2f}M"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
