"""Reading a Hugging Face checkpoint of a supported family for the native builder: config, quantization, tensors.

Plain checkpoints and modelopt's unified exports (``hf_quant_config.json`` / ``config.json`` quantization_config
with quant_algo "FP8" or "W4A16_AWQ") are understood. Weights are read from safetensors only, never unpickled.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kiln.engines.cache.hashing import COPIED_SNAPSHOT_FIX, dangling_link
from kiln.engines.eos import declared_eos, generation_eos_ids, stopping_eos_ids
from kiln.runtime.errors import KilnError
from kiln.runtime.json_files import is_number, read_json_object
from kiln.runtime.native.engine_format import Architecture, architecture_size_problem
from kiln.runtime.native.layers.activation import ACTIVATION_ALIASES, ACTIVATIONS
from kiln.runtime.native.layers.rotary import ROPE_TYPES, frequency_problem
from kiln.runtime.native.model.registry import family_of, flag, positive_number

QUANT_ALGOS = {None: "none", "FP8": "fp8", "W4A16_AWQ": "int4_awq"}
# the rope scaling parameters that are numbers wherever a scaled type reads them
ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim")
# config.json's names of the Architecture fields it names otherwise
CONFIG_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads"}


@dataclass(frozen=True)
class SourceQuantization:
    """What the checkpoint's quantization metadata declares."""

    format: str = "none"
    group_size: int | None = None
    fp8_kv_cache: bool = False


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file, raising KilnError naming the file when it is unreadable."""
    return read_json_object(path, KilnError, "re-export the checkpoint")


def read_architecture(checkpoint_dir: Path, tokenizer_dir: Path | None = None) -> tuple[Architecture, dict[str, Any]]:
    """The architecture of ``config.json`` (+ the ids of the generation_config.json and tokenizer of
    ``tokenizer_dir``, else of ``checkpoint_dir``), and the raw config dict."""
    path = checkpoint_dir / "config.json"
    _refuse_dangling_link(path)
    if not path.is_file():
        raise KilnError(f"{checkpoint_dir}: no config.json; point the build at a Hugging Face checkpoint directory")
    cfg = read_json(path)
    tokenizer_dir = checkpoint_dir if tokenizer_dir is None else tokenizer_dir
    gen_path = tokenizer_dir / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else {}
    try:
        architecture = parse_architecture(cfg, gen, path)
    except (TypeError, ValueError, KeyError) as e:  # a bad value that parse_architecture does not name itself
        raise KilnError(f"{path}: a field has the wrong type or value ({e}); fix config.json") from None
    return replace(architecture, eos_token_ids=stopping_eos_ids(tokenizer_dir, cfg, gen)), cfg


def parse_architecture(cfg: dict[str, Any], gen: dict[str, Any], path: Path) -> Architecture:
    """The architecture of a parsed config.json (``path`` names it in errors) and generation_config.json: the
    fields every family shares, then its family's quirks (``runtime/native/model/registry.py``)."""
    family = family_of(cfg, path)
    cfg = family.with_defaults(cfg)
    activation = ACTIVATION_ALIASES.get(cfg[family.activation_key], cfg[family.activation_key])
    if activation not in ACTIVATIONS:
        raise KilnError(f"{path}: {family.activation_key} {activation!r} is not supported by the native backend "
                        f"(supported: {', '.join([*ACTIVATIONS, *ACTIVATION_ALIASES])})")
    num_heads = _int(cfg, "num_attention_heads", path)
    num_kv_heads = num_heads if cfg.get("num_key_value_heads") is None else _int(cfg, "num_key_value_heads", path)
    if num_heads % num_kv_heads:
        raise KilnError(f"{path}: num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads "
                        f"({num_kv_heads})")
    hidden = _int(cfg, "hidden_size", path)
    head_dim = hidden // num_heads if cfg.get("head_dim") is None else _int(cfg, "head_dim", path)
    if head_dim % 2:
        raise KilnError(f"{path}: head_dim {head_dim} is odd; rotary embeddings rotate pairs of dimensions, so it must "
                        "be even")
    sizes = dict(vocab_size=_int(cfg, "vocab_size", path), hidden_size=hidden,
                 intermediate_size=_int(cfg, "intermediate_size", path),
                 num_layers=_int(cfg, "num_hidden_layers", path), num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim)
    if (problem := architecture_size_problem(sizes, CONFIG_NAMES)) is not None:  # before anything is allocated
        raise KilnError(f"{path}: {problem}; fix config.json")
    _check_eos_ids(cfg, gen, sizes["vocab_size"], path)
    _check_dtype(cfg, path)
    # a top-level original_max_position_embeddings comes first wherever config.json has one (transformers'
    # standardize_rope_params: hasattr(config, ...)), and always for Phi-3, whose config class has the field
    rope_theta, rope_scaling = _rope(cfg, "original_max_position_embeddings" in cfg, path, family.rope_types,
                                     family.partial_rotary)
    _check_rope(head_dim, rope_theta, rope_scaling, path)
    shared = dict(
        **sizes,
        rms_norm_eps=positive_number(cfg["rms_norm_eps"], "rms_norm_eps", path),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=flag(cfg, "tie_word_embeddings", path),
        max_position_embeddings=_int(cfg, "max_position_embeddings", path),
        bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
        eos_token_ids=generation_eos_ids(cfg, gen),
        hidden_act=activation,
    )
    return Architecture(**{**shared, **family.quirks(cfg, path)}, type=family.name)  # quirks win over the defaults


def read_quantization(checkpoint_dir: Path, cfg: dict[str, Any]) -> SourceQuantization:
    """The quantization declared by hf_quant_config.json (preferred) or config.json's quantization_config."""
    hf_quant = checkpoint_dir / "hf_quant_config.json"
    if hf_quant.is_file():
        source, section = hf_quant, read_json(hf_quant).get("quantization", {})
    else:
        source, section = checkpoint_dir / "config.json", cfg.get("quantization_config") or {}
    algo = section.get("quant_algo")
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if algo is None and method not in (None, "modelopt"):  # AutoAWQ, GPTQ, compressed-tensors, bitsandbytes, ...
        raise KilnError(f"{checkpoint_dir / 'config.json'}: quantization_config quant_method {method!r} is not "
                        "supported by the native backend (supported: modelopt's FP8 and W4A16_AWQ exports); build "
                        "from the unquantized checkpoint with quantize.format fp8 or int4_awq")
    if algo not in QUANT_ALGOS:
        raise KilnError(f"{source}: quant_algo {algo!r} is not supported by the native backend "
                        f"(supported: FP8, W4A16_AWQ, or unquantized)")
    kv_algo = section.get("kv_cache_quant_algo")
    if kv_algo not in (None, "FP8"):
        raise KilnError(f"{source}: kv_cache_quant_algo {kv_algo!r} is not supported (supported: FP8 or none)")
    group_size = section.get("group_size", 128) if algo == "W4A16_AWQ" else None
    if algo == "W4A16_AWQ" and (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0):
        raise KilnError(f"{source}: group_size {group_size!r} must be a positive integer; re-export the checkpoint")
    if algo == "W4A16_AWQ" and section.get("has_zero_point"):
        raise KilnError(f"{source}: W4A16_AWQ with zero points is not supported; export symmetric AWQ")
    return SourceQuantization(QUANT_ALGOS[algo], group_size, kv_algo == "FP8")


class CheckpointTensors:
    """Lazy access to the safetensors of a checkpoint (a single file, or the shards its index lists), tracking use.

    A tensor that a listed shard holds but the index's weight_map omits is found there, as transformers loads every
    tensor of the shards an index lists; it is not reported as unused, as the index never declared it."""

    def __init__(self, checkpoint_dir: Path) -> None:
        self._dir = checkpoint_dir
        index = checkpoint_dir / "model.safetensors.index.json"
        single = checkpoint_dir / "model.safetensors"
        for path in (index, single):
            _refuse_dangling_link(path)
        self._unindexed: dict[str, Path] = {}
        if index.is_file():
            weight_map = read_json(index).get("weight_map", {})
            if not isinstance(weight_map, dict):
                raise KilnError(f"{index}: weight_map is a {type(weight_map).__name__}, not an object mapping each "
                                "tensor name to its shard file; re-export the checkpoint")
            self._files = {name: _shard(checkpoint_dir, index, fname) for name, fname in weight_map.items()}
            self._unindexed = _unindexed_tensors(index, self._files)
            self._source = f"the shards {index.name} lists"
        elif single.is_file():
            with _open(single) as f:
                self._files = dict.fromkeys(f.keys(), single)
            self._source = single.name
        else:
            raise KilnError(f"{checkpoint_dir}: no model.safetensors or model.safetensors.index.json; the native "
                            "builder reads safetensors only (re-save the checkpoint with safe_serialization=True)")
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._files or name in self._unindexed

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``; KilnError when the checkpoint lacks it."""
        path = self._file(name)
        self.used.add(name)
        with _open(path) as f:
            return f.get_tensor(name)

    def dtype(self, name: str) -> str:
        """The safetensors dtype of ``name`` ("BF16", "F8_E4M3", "U8", ...), read from the header alone."""
        with _open(self._file(name)) as f:
            return f.get_slice(name).get_dtype()

    def _file(self, name: str) -> Path:
        path = self._files.get(name) or self._unindexed.get(name)
        if path is None:
            raise KilnError(f"{self._dir}: no tensor {name!r} in {self._source}; the checkpoint is "
                            "incomplete or not in its family's layout")
        return path

    def unused(self) -> list[str]:
        """Names never read, other than rotary caches some checkpoints carry."""
        return sorted(n for n in self._files if n not in self.used and not n.endswith("rotary_emb.inv_freq"))


def _refuse_dangling_link(path: Path) -> None:
    if problem := dangling_link(path):
        raise KilnError(f"{path.parent}: {problem}: {COPIED_SNAPSHOT_FIX}")


def _shard(checkpoint_dir: Path, index: Path, name: object) -> Path:
    """The shard file an index names: a file name inside the checkpoint directory, nothing outside it."""
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise KilnError(f"{index}: weight_map names {name!r}, not a file in the checkpoint directory; re-export the "
                        "checkpoint")
    return checkpoint_dir / name


def _unindexed_tensors(index: Path, files: dict[str, Path]) -> dict[str, Path]:
    """The tensors the shards of ``files`` hold that the index does not map, each in the first shard (by name) that
    holds it; an index that puts a tensor in a shard that does not hold it is refused. Only the shards' headers are
    read, before anything is converted."""
    unindexed: dict[str, Path] = {}
    for shard in sorted(set(files.values())):
        with _open(shard) as f:
            held = set(f.keys())
        if missing := sorted(name for name, path in files.items() if path == shard and name not in held):
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise KilnError(f"{index}: weight_map puts tensor {missing[0]!r}{more} in {shard.name}, which does not "
                            "hold it; re-export the checkpoint, or fix the index")
        for name in held - files.keys():
            unindexed.setdefault(name, shard)
    return unindexed


def _open(path: Path):
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        raise KilnError(f"{path}: the path is not valid UTF-8, which the safetensors library cannot open; rename the "
                        "checkpoint's folder (or a folder above it)") from None
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (OSError, SafetensorError) as e:
        _refuse_dangling_link(path)  # a shard of a copied hub snapshot, named as such
        raise KilnError(f"{path}: unreadable safetensors ({e}); re-export the checkpoint") from None


def _check_dtype(cfg: dict[str, Any], path: Path) -> None:
    """Refuses a ``dtype`` (transformers 5) or ``torch_dtype`` that is neither null nor the name of a torch dtype
    ("bfloat16", "float16", "float32", ...), which is how transformers and the quantize stage read it."""
    for key in ("dtype", "torch_dtype"):
        value = cfg.get(key)
        if value is not None and not (isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)):
            raise KilnError(f"{path}: {key} {value!r} is not the name of a torch dtype (such as \"bfloat16\", "
                            f"\"float16\" or \"float32\"); fix config.json")


def _check_eos_ids(cfg: dict[str, Any], gen: dict[str, Any], vocab_size: int, path: Path) -> None:
    """Refuses an ``eos_token_id`` that is not a token id of the vocabulary, in the file the ids are taken from
    (``declared_eos``)."""
    name, value = declared_eos(cfg, gen)
    source = path if name == "config.json" else path.with_name(name)  # the config read: a bench's architecture file
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if bad := [i for i in ids if type(i) is not int or not 0 <= i < vocab_size]:
        holds = f" holds {bad[0]!r}," if isinstance(value, list) else " is"
        raise KilnError(f"{source}: eos_token_id {value!r}{holds} not a token id of the vocabulary (0 to "
                        f"{vocab_size - 1}); fix {source.name}")


def _int(cfg: dict[str, Any], key: str, path: Path) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KilnError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def _rope(cfg: dict[str, Any], top_level_context: bool, path: Path, family_types: dict[str, str] | None = None,
          partial_rotary: bool = False) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from transformers-5 ``rope_parameters`` or older ``rope_scaling``;
    ``top_level_context``: config.json's own ``original_max_position_embeddings`` comes first; ``family_types``:
    the family's ``rope_types``, where its config class takes only those; ``partial_rotary``: the family's plain
    RoPE applies ``partial_rotary_factor`` (Phi-3's does; Llama's and the others' rotate every dimension)."""
    source = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"  # transformers: rope_scaling wins
    params = cfg.get(source) or {}
    if not isinstance(params, dict):
        raise KilnError(f"{path}: {source} must be an object such as {{\"rope_type\": \"linear\", \"factor\": 2.0}}, "
                        f"got {params!r}")
    nested = [key for key, value in params.items() if isinstance(value, dict)]
    if nested:
        raise KilnError(f"{path}: {source} per layer type ({', '.join(nested)}) is not supported by the native "
                        "backend; give one set of rope parameters for every layer")
    params = dict(params)
    theta = positive_number(params.pop("rope_theta", cfg["rope_theta"]), "rope_theta", path)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    # transformers moves a top-level factor into the rope parameters, where the scaled types and some families'
    # plain RoPE apply it (and a family that rotates every dimension then fails); the others' plain RoPE ignores it
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and (partial_rotary or rope_type != "default"):
        raise KilnError(f"{path}: partial_rotary_factor {partial} is not supported by the native backend (it "
                        "rotates every dimension of a head)")
    if family_types is not None:
        if rope_type not in family_types:
            raise KilnError(f"{path}: rope type {rope_type!r} is not one this architecture takes (transformers "
                            f"takes {', '.join(family_types)})")
        rope_type = family_types[rope_type]
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)  # Phi-3's first name for it
    if rope_type not in ROPE_TYPES + ("dynamic",):
        raise KilnError(f"{path}: rope type {rope_type!r} is not supported (supported: "
                        f"{', '.join(ROPE_TYPES + ('dynamic',))})")
    if rope_type != "default":  # the plain RoPE reads none of them
        if rope_type != "longrope" and params.get("factor") is None:  # as transformers' rope validation refuses it
            raise KilnError(f"{path}: rope scaling {rope_type!r} needs key 'factor'")
        _check_scaling(params, source, path)
    if rope_type == "dynamic":  # transformers' dynamic NTK changes no frequency up to max_position_embeddings,
        return theta, None  # the longest context a plan may hold (engines/native/plan.py)
    if rope_type in ("llama3", "longrope", "yarn"):
        params["original_max_position_embeddings"] = _original_context(cfg, params, top_level_context, path)
    if rope_type == "longrope":
        params.update(_longrope_defaults(cfg, params, path))
    if rope_type == "yarn":
        params.update(_yarn_defaults(params))
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **params}


def _check_scaling(params: dict[str, Any], source: str, path: Path) -> None:
    """Refuses the scaling parameters of ``source`` that transformers' rope validation calls invalid, before they
    make frequencies that are not finite: a value that is not a number, a factor not above 0, a low_freq_factor not
    above 0 or not below high_freq_factor, a negative attention_factor or beta_slow, beta_fast below beta_slow. A
    factor between 0 and 1 is taken, as transformers runs it (with a warning)."""
    for key in ROPE_NUMBERS:
        if params.get(key) is not None and not is_number(params[key]):
            raise KilnError(f"{path}: {source} {key} must be a number, got {params[key]!r}; fix config.json")
    value = {key: params.get(key) for key in ROPE_NUMBERS}
    rules = (("factor", value["factor"] is None or value["factor"] > 0, "positive"),
             ("low_freq_factor", value["low_freq_factor"] is None or value["low_freq_factor"] > 0, "positive"),
             ("high_freq_factor", value["high_freq_factor"] is None
              or value["high_freq_factor"] > (value["low_freq_factor"] or 0), "above low_freq_factor"),
             ("attention_factor", value["attention_factor"] is None or value["attention_factor"] >= 0,
              "not negative"),
             ("beta_slow", value["beta_slow"] is None or value["beta_slow"] >= 0, "not negative"),
             ("beta_fast", (value["beta_fast"] or 32) >= (value["beta_slow"] or 1), "at least beta_slow"))
    for key, valid, rule in rules:
        if not valid:
            raise KilnError(f"{path}: {source} {key} {value[key]!r} must be {rule}; fix config.json")


def _original_context(cfg: dict[str, Any], params: dict[str, Any], top_level_context: bool, path: Path) -> int:
    """The pretraining context that Llama-3 and LongRoPE scaling start from, as transformers standardises it: the
    top-level ``original_max_position_embeddings`` where ``top_level_context`` (Phi-3 keeps it there), else the rope
    parameters', else ``max_position_embeddings``."""
    key = "original_max_position_embeddings"
    for value in ((cfg.get(key),) if top_level_context else ()) + (params.get(key),):
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise KilnError(f"{path}: original_max_position_embeddings must be a positive integer, got {value!r}")
            return value
    return _int(cfg, "max_position_embeddings", path)


def _longrope_defaults(cfg: dict[str, Any], params: dict[str, Any], path: Path) -> dict[str, Any]:
    """LongRoPE's factor and attention factor where the config leaves them to transformers' defaults (the factor
    from max_position_embeddings / original_max_position_embeddings)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or _int(cfg, "max_position_embeddings", path) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return {"factor": factor, "attention_factor": attention}


def _yarn_defaults(params: dict[str, Any]) -> dict[str, Any]:
    """YaRN's parameters where the config leaves them to transformers' defaults: the attention factor from the
    factor (and mscale / mscale_all_dim), beta_fast 32, beta_slow 1, a truncated correction range."""
    factor = params["factor"]  # required, as transformers requires it

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 0.1 * weight * math.log(scale) + 1.0 if scale > 1 else 1.0

    attention = params.get("attention_factor")
    if attention is None:
        weight, all_dims = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, weight) / mscale(factor, all_dims) if weight and all_dims else mscale(factor)
    return {"factor": factor, "attention_factor": float(attention), "beta_fast": params.get("beta_fast") or 32,
            "beta_slow": params.get("beta_slow") or 1, "truncate": params.get("truncate", True)}


def _check_rope(head_dim: int, theta: float, scaling: dict[str, Any] | None, path: Path) -> None:
    """Refuses rope parameters that lack a key their type needs, or that give frequencies that are not finite."""
    try:
        problem = frequency_problem(head_dim, theta, scaling)
    except KeyError as e:
        raise KilnError(f"{path}: rope scaling {scaling.get('rope_type')!r} needs key {e}") from None
    if problem is not None:
        raise KilnError(f"{path}: {problem}; fix config.json")
