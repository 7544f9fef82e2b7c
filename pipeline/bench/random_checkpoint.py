"""The seeded random-weight checkpoints that ``kiln bench`` makes of an architecture file, kept in the engine cache's
``checkpoints`` store: bf16 (then quantized by the pipeline like any model), or FP8 made directly, in modelopt's
export layout, for models whose bf16 weights outgrow the disk or one GPU (Llama-3-70B: 141 GB).

Linears are N(0, initializer_range), norms 1. The FP8 checkpoint holds each decoder linear as float8 values of
N(0, 64) with the weight scale ``std / 64`` (so the dequantized weights have the bf16 checkpoint's spread), a static
input scale, and with an FP8 KV cache unit K/V scales; the embedding and the LM head stay bf16, as modelopt leaves
them. Either is a byte-level tokenizer over the whole vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.engines.cache import EngineCache, engine_key
from kiln.pipeline.bench.target import is_decoder_linear, param_count, weight_shapes
from kiln.pipeline.key_material import KEY_SCHEMA

SHARD_BYTES = 2 * 10**9
CHECKPOINT_VERSION = 2  # bump when the random checkpoint's bytes change for the same inputs
FP8_SPREAD = 64.0  # the FP8 values' standard deviation: 7 of them to the format's largest, 448
FP8_INPUT_SCALE = 4.0 / 448  # activations of about unit RMS after each norm, their largest about 4

Progress = Callable[[str], None]


def random_checkpoint(cache: EngineCache, arch_path: Path, cfg: dict, *, seed: int, device: str, progress: Progress,
                      fp8: bool = False, fp8_kv_cache: bool = False) -> Path:
    """The checkpoint of ``cfg`` (bf16, or with ``fp8`` FP8 linears and, with ``fp8_kv_cache``, K/V scales), made
    once per architecture, seed, format and kind of device (the generator's numbers differ between CPU and CUDA)."""
    material = {"key_schema": KEY_SCHEMA, "kind": "random_checkpoint", "architecture": cfg, "seed": seed,
                "dtype": "bfloat16", "generator": torch.device(device).type, "version": CHECKPOINT_VERSION}
    if fp8:
        material["fp8"] = {"kv_cache": fp8_kv_cache, "spread": FP8_SPREAD, "input_scale": FP8_INPUT_SCALE}
    label = "FP8" if fp8 else "bf16"

    def build(tmp: Path) -> dict:
        progress(f"writing a random-weight {label} checkpoint ({human_params(param_count(cfg))} parameters, "
                 f"seed {seed})")
        _write_random_weights(tmp, cfg, seed, device, fp8=fp8, fp8_kv_cache=fp8_kv_cache)
        (tmp / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}, indent=2, sort_keys=True) + "\n")
        if fp8:
            quantization = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if fp8_kv_cache else None,
                            "exclude_modules": ["lm_head"]}
            (tmp / "hf_quant_config.json").write_text(json.dumps(
                {"producer": {"name": "kiln bench", "version": "random"}, "quantization": quantization}, indent=2))
        _write_byte_level_tokenizer(tmp, cfg)
        return {"seed": seed, "architecture_file": str(arch_path)}

    describe = {"model": arch_path.stem, "format": f"{label.lower()} random", "backend": "-", "gpu": "-"}
    return cache.checkpoints.get_or_build(engine_key(material), material, build, describe=describe,
                                          on_wait=progress).payload_dir


def human_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.2f}M"


Planned = tuple[str, tuple[int, ...], torch.dtype, float | None]  # name, shape, dtype, a constant fill or random


def _planned_tensors(cfg: dict, *, fp8: bool, fp8_kv_cache: bool) -> list[Planned]:
    """Every tensor of the checkpoint: name, shape, dtype, and the value that fills it (None: random)."""
    std = float(cfg.get("initializer_range", 0.02))
    planned: list[Planned] = []
    for name, shape in weight_shapes(cfg).items():
        norm = 1.0 if name.endswith("norm.weight") else None
        if not (fp8 and is_decoder_linear(name, shape)):
            planned.append((name, shape, torch.bfloat16, norm))
            continue
        module = name.removesuffix(".weight")
        planned += [(name, shape, torch.float8_e4m3fn, None),
                    (f"{module}.weight_scale", (), torch.float32, std / FP8_SPREAD),
                    (f"{module}.input_scale", (), torch.float32, FP8_INPUT_SCALE)]
        if fp8_kv_cache and module.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            kind = module[-6]  # "k" of k_proj, "v" of v_proj
            planned.append((f"{module}.{kind}_scale", (), torch.float32, 1.0))
    return planned


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float | None, cfg: dict, seed: int,
                   device: str) -> torch.Tensor:
    if fill is not None:
        return torch.full(shape, fill, dtype=dtype)
    tensor_seed = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")
    generator = torch.Generator(device=device).manual_seed(tensor_seed)
    values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    if dtype == torch.float8_e4m3fn:
        return (values * FP8_SPREAD).clamp_(-448, 448).to(dtype).cpu()
    return (values * float(cfg.get("initializer_range", 0.02))).to(dtype).cpu()


def _write_random_weights(out: Path, cfg: dict, seed: int, device: str, *, fp8: bool, fp8_kv_cache: bool) -> None:
    """The tensors in safetensors shards of about 2 GB, with an index."""
    from safetensors.torch import save_file

    planned = _planned_tensors(cfg, fp8=fp8, fp8_kv_cache=fp8_kv_cache)
    shards: list[list[Planned]] = [[]]
    size = 0
    for entry in planned:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    weight_map = {}
    for k, entries in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _random_tensor(name, shape, dtype, fill, cfg, seed, device)
                   for name, shape, dtype, fill in entries}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype, _ in planned)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_byte_level_tokenizer(out: Path, cfg: dict) -> None:
    """The 256 bytes, then tokens ``t256 .. t{vocab-1}`` that encoding never produces: the engine is driven with token
    ids, this keeps decoding total, and text encodes byte by byte, so a grammar engine can run structured output."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = cfg["vocab_size"]
    names = (sorted(pre_tokenizers.ByteLevel.alphabet()) + [f"t{i}" for i in range(256, vocab)])[:vocab]
    tokenizer = Tokenizer(BPE({name: i for i, name in enumerate(names)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")

