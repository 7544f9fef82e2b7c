"""The native engine directory: ``engine.json`` (this module), ``rank0.safetensors`` and the tokenizer files.

``engine.json`` holds the model architecture, the compute dtype, the quantization, the build plan and the
fingerprint of the machine the engine was built for. Weights in ``rank0.safetensors`` are in runtime layout
(fused QKV and gate-up projections; see ``runtime/native/layers/linear.py`` for the quantized formats).
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field, fields
from fnmatch import fnmatch
from itertools import chain
from pathlib import Path
from typing import Any

import torch

from kiln.runtime.errors import EngineFormatError
from kiln.runtime.json_files import is_number
from kiln.runtime.native.layers.activation import ACTIVATIONS
from kiln.runtime.native.layers.rotary import frequency_problem
from kiln.runtime.native.model.registry import FAMILY_NAMES, LAYER_TYPES
from kiln.runtime.plan import BuildPlan, PlanError

ENGINE_FORMAT = "kiln-native"
# 2: a reader refuses a field it does not know. Readers of 1 dropped one, so an engine whose newer field changes what
# it computes (an activation, a soft cap) ran wrong in an older Kiln; they refuse 2. This Kiln reads 1 too, as 2 with
# every later field at its default.
ENGINE_FORMAT_VERSION = 2
READ_FORMAT_VERSIONS = (1, 2)
ENGINE_JSON = "engine.json"


def weights_file(rank: int) -> str:
    """The weight file of tensor-parallel rank ``rank`` (``rank0.safetensors`` for a one-device engine)."""
    return f"rank{rank}.safetensors"


DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_CACHE_DTYPES: dict[str, torch.dtype] = {**DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}
QUANT_FORMATS = ("none", "fp8", "int4_awq")


@dataclass(frozen=True)
class Architecture:
    """Shape and hyper-parameters of a decoder; ``type`` names its family (``runtime/native/model/registry.py``),
    whose quirks are the fields after it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    type: str = "llama"
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    o_bias: bool = False  # a bias on the output projection
    mlp_bias: bool = False  # biases on the gate, up and down projections
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotary embedding (Qwen3)
    sliding_window: int | None = None  # the layers ``layer_types`` marks "sliding_attention" see this many positions
    layer_types: list[str] | None = None  # per layer "full_attention" or "sliding_attention"; None: all full
    hidden_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma 2)
    sandwich_norms: bool = False  # RMSNorms after attention and after the MLP too, before each residual add (Gemma 2)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), in the model dtype (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma 2), else head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # scores = cap * tanh(scores / cap) before the softmax (Gemma 2)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)

    def layer_window(self, index: int) -> int | None:
        """How many positions layer ``index`` attends to (itself included); None for all of them."""
        sliding = self.layer_types is not None and self.layer_types[index] == "sliding_attention"
        return self.sliding_window if sliding else None


# no model comes near these (Llama-3-405B: 126 layers; a 262k vocabulary x 16k hidden is 2**32 elements); a size past
# them is a typo or a hostile file, which would otherwise overflow torch's size arithmetic or allocate until it dies
MAX_LAYERS = 10_000
MAX_TENSOR_ELEMENTS = 2**40
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def architecture_size_problem(sizes: dict[str, Any], names: dict[str, str] | None = None) -> str | None:
    """Why an architecture whose SIZE_FIELDS are ``sizes`` (other keys are ignored) is no model that can be
    allocated: a size that is not a positive integer, more than MAX_LAYERS layers, or a weight of more than
    MAX_TENSOR_ELEMENTS elements; None when it is none of these. ``names``: what the file being read calls a field,
    where it is not the Architecture's name (config.json's ``num_hidden_layers``)."""
    def called(name: str) -> str:
        return (names or {}).get(name, name)

    for name in SIZE_FIELDS:
        if type(sizes[name]) is not int or sizes[name] <= 0:
            return f"{called(name)} must be a positive integer, got {sizes[name]!r}"
    if sizes["num_layers"] > MAX_LAYERS:
        return f"{called('num_layers')} {sizes['num_layers']} is more than {MAX_LAYERS:,}: no model has that many"
    hidden, heads = sizes["hidden_size"], sizes["num_heads"] + 2 * sizes["num_kv_heads"]
    weights = {
        "embed_tokens": (("vocab_size", "hidden_size"), sizes["vocab_size"] * hidden),
        "qkv_proj": (("num_heads", "num_kv_heads", "head_dim", "hidden_size"), heads * sizes["head_dim"] * hidden),
        "gate_up_proj": (("intermediate_size", "hidden_size"), 2 * sizes["intermediate_size"] * hidden),
    }
    for weight, (used, elements) in weights.items():
        if elements > MAX_TENSOR_ELEMENTS:
            given = ", ".join(f"{called(name)} {sizes[name]}" for name in used)
            return f"{given} make {weight} a tensor of {elements:.3g} elements, above the 2**40 no model's weight has"
    return None


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight format of the linears; ``exclude_modules`` lists runtime module names kept in the engine dtype;
    ``fp8_streaming_max_m`` maps an FP8 linear shape ``"{in}x{out}"`` to the largest token count its
    weight-streaming kernel serves, as measured by a CUDA build (``engines.native.tuning``); a shape it lacks
    takes the runtime's default."""

    format: str = "none"
    group_size: int | None = None
    kv_cache_dtype: str = "auto"
    exclude_modules: list[str] = field(default_factory=list)
    fp8_streaming_max_m: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def shape_key(in_features: int, out_features: int) -> str:
        """The key of a linear shape in ``fp8_streaming_max_m``."""
        return f"{in_features}x{out_features}"


@dataclass(frozen=True)
class EngineConfig:
    """The parsed ``engine.json`` of a native engine; its plan's ``kv_cache_dtype`` is a key of ``KV_CACHE_DTYPES``."""

    architecture: Architecture
    dtype: str
    quantization: QuantizationConfig
    plan: BuildPlan
    fingerprint: dict[str, Any]
    format_version: int = ENGINE_FORMAT_VERSION
    tp_size: int = 1  # tensor-parallel ranks, each with its weights_file(rank) (runtime/native/parallel/sharding.py)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype of the engine."""
        return DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The dtype of the paged KV cache."""
        return KV_CACHE_DTYPES[self.plan.kv_cache_dtype]

    @classmethod
    def load(cls, engine_dir: Path) -> EngineConfig:
        """Read and validate ``engine_dir/engine.json``; raise EngineFormatError when it is not a native engine."""
        path = Path(engine_dir) / ENGINE_JSON
        if not path.is_file():
            if (Path(engine_dir) / "config.json").is_file():
                raise EngineFormatError(f"{engine_dir}: a Hugging Face checkpoint (config.json), not an engine: build "
                                        f"one from it with `kiln build` and load the directory it prints")
            if (Path(engine_dir) / "engine").is_dir():  # a cache entry, which holds its engine in engine/
                raise EngineFormatError(f"{engine_dir}: no {ENGINE_JSON}, but an engine/ folder: load "
                                        f"{Path(engine_dir) / 'engine'}")
            raise EngineFormatError(f"{engine_dir}: no {ENGINE_JSON}, so not a kiln engine: pass the directory `kiln "
                                    f"build` printed (`kiln cache show KEY` shows a cached engine's)")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise EngineFormatError(f"{path}: unreadable ({e}); rebuild the engine") from None
        try:
            return cls.from_dict(data)
        except EngineFormatError as e:
            raise EngineFormatError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Build from the engine.json dict, checking the format marker, version and every section."""
        if not isinstance(data, dict) or data.get("format") != ENGINE_FORMAT:
            raise EngineFormatError(f"format is not {ENGINE_FORMAT!r}; not a kiln native engine")
        if data.get("format_version") not in READ_FORMAT_VERSIONS:
            raise EngineFormatError.of_version(data.get("format_version"), ENGINE_FORMAT_VERSION)
        _refuse_unknown("", data, {*TOP_LEVEL_KEYS})
        _refuse_unknown("parallel.", _section_or_default(data, "parallel"), {"tp_size"})
        _refuse_unknown("plan.", _required(data, "plan"), {f.name for f in fields(BuildPlan)})
        config = cls(
            architecture=_section(Architecture, data, "architecture"),
            dtype=_required(data, "dtype"),
            quantization=_section(QuantizationConfig, data, "quantization"),
            plan=_plan(_required(data, "plan")),
            fingerprint=_required(data, "fingerprint"),
            format_version=data["format_version"],
            tp_size=_section_or_default(data, "parallel").get("tp_size", 1),
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Raise EngineFormatError naming the first value outside what the runtime supports (``FIELD_RULES``, then
        ``_relations`` and the rotary embedding's ``_rope_problem``), before anything is allocated."""
        if (problem := architecture_size_problem(vars(self.architecture))) is not None:  # before any arithmetic
            raise EngineFormatError(f"architecture: {problem}")
        values = {"dtype": self.dtype, "fingerprint": self.fingerprint, "parallel.tp_size": self.tp_size,
                  "plan.kv_cache_dtype": self.plan.kv_cache_dtype,
                  **{f"architecture.{name}": value for name, value in vars(self.architecture).items()},
                  **{f"quantization.{name}": value for name, value in vars(self.quantization).items()}}
        rules = ((path, check(values[path]), requirement) for path, (check, requirement) in FIELD_RULES.items())
        for path, ok, requirement in chain(rules, _relations(self)):  # a relation runs once every field passed
            if not ok:
                raise EngineFormatError(f"{path} must be {requirement}, got {reprlib.repr(values[path])}; {FIX}")
        if (problem := _rope_problem(self.architecture)) is not None:
            raise EngineFormatError(f"{problem}; {FIX}")

    def to_dict(self) -> dict[str, Any]:
        """The engine.json dict."""
        return {
            "format": ENGINE_FORMAT,
            "format_version": self.format_version,
            "architecture": asdict(self.architecture),
            "dtype": self.dtype,
            "quantization": asdict(self.quantization),
            "plan": self.plan.to_dict(),
            "fingerprint": dict(self.fingerprint),
            "parallel": {"tp_size": self.tp_size},
        }

    def to_json(self) -> str:
        """The engine.json text (sorted keys, indented)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save(self, engine_dir: Path) -> None:
        """Write ``engine_dir/engine.json``."""
        (Path(engine_dir) / ENGINE_JSON).write_text(self.to_json())


FIX = "fix engine.json or rebuild the engine"
Rule = tuple[Callable[[Any], bool], str]  # a check of one value, and what the value must be (for the message)


def _positive_int(value: Any) -> bool:
    return type(value) is int and value > 0  # type(): True is an int to isinstance


def _non_negative_int(value: Any) -> bool:
    return type(value) is int and value >= 0


def _positive_number(value: Any) -> bool:
    return is_number(value) and value > 0


def _non_negative_number(value: Any) -> bool:
    return is_number(value) and value >= 0


def _one_of(names: Collection[str]) -> Rule:
    return (lambda value: type(value) is str and value in names), f"one of {', '.join(names)}"


def _optional(rule: Rule) -> Rule:
    check, requirement = rule
    return (lambda value: value is None or check(value)), f"null or {requirement}"


def _list_of(rule: Rule) -> Rule:
    check, requirement = rule
    return (lambda value: type(value) is list and all(check(item) for item in value)), f"a list, each {requirement}"


FLAG: Rule = (lambda value: type(value) is bool, "true or false")
STRING: Rule = (lambda value: type(value) is str, "a string")
POSITIVE_INT: Rule = (_positive_int, "a positive integer")
POSITIVE_NUMBER: Rule = (_positive_number, "a finite number above 0")
NON_NEGATIVE_NUMBER: Rule = (_non_negative_number, "a finite number not below 0")
TOKEN_ID: Rule = (_non_negative_int, "an integer not below 0")
OBJECT: Rule = (lambda value: type(value) is dict, "an object")

# every value of engine.json a runtime reads, by its place in the file, but the architecture's SIZE_FIELDS
# (architecture_size_problem, first) and the relations between values (_relations, after these)
FIELD_RULES: dict[str, Rule] = {
    "dtype": _one_of(DTYPES),
    "fingerprint": OBJECT,
    "parallel.tp_size": POSITIVE_INT,
    "plan.kv_cache_dtype": _one_of(KV_CACHE_DTYPES),
    "architecture.type": _one_of(FAMILY_NAMES),
    "architecture.rms_norm_eps": POSITIVE_NUMBER,
    "architecture.rope_theta": POSITIVE_NUMBER,
    "architecture.rope_scaling": _optional(OBJECT),  # its keys: ROPE_SCALING_RULES
    "architecture.tie_word_embeddings": FLAG,
    "architecture.max_position_embeddings": POSITIVE_INT,
    "architecture.bos_token_id": _optional(TOKEN_ID),
    "architecture.eos_token_ids": _list_of(TOKEN_ID),
    "architecture.qkv_bias": FLAG,
    "architecture.o_bias": FLAG,
    "architecture.mlp_bias": FLAG,
    "architecture.qk_norm": FLAG,
    "architecture.sliding_window": _optional(POSITIVE_INT),
    "architecture.layer_types": _optional(_list_of(_one_of(LAYER_TYPES))),
    "architecture.hidden_act": _one_of(ACTIVATIONS),  # gated_activation runs GeLU for any name but "silu"
    "architecture.sandwich_norms": FLAG,
    "architecture.scale_embeddings": FLAG,
    "architecture.query_pre_attn_scalar": _optional(POSITIVE_NUMBER),  # ** -0.5: 0 divides by zero
    "architecture.attn_logit_softcapping": _optional(POSITIVE_NUMBER),  # cap * tanh(x / cap)
    "architecture.final_logit_softcapping": _optional(POSITIVE_NUMBER),
    "quantization.format": _one_of(QUANT_FORMATS),
    "quantization.group_size": _optional(POSITIVE_INT),
    "quantization.kv_cache_dtype": STRING,  # a record of the build's choice: the runtime reads plan.kv_cache_dtype
    "quantization.exclude_modules": _list_of(STRING),
    "quantization.fp8_streaming_max_m": (lambda value: type(value) is dict and all(
        _non_negative_int(m) for m in value.values()), "an object of integers not below 0"),
}


def _relations(config: EngineConfig) -> Iterator[tuple[str, bool, str]]:
    """(place in engine.json, whether its value agrees with the others, what it must be) for the values that depend
    on others, in order: each may do arithmetic on those before it, and on every FIELD_RULES value."""
    arch, quant = config.architecture, config.quantization
    yield "architecture.head_dim", arch.head_dim % 2 == 0, "even (rotary embeddings rotate pairs of dimensions)"
    yield ("architecture.num_heads", arch.num_heads % arch.num_kv_heads == 0,
           f"a multiple of num_kv_heads ({arch.num_kv_heads})")
    yield ("architecture.bos_token_id", arch.bos_token_id is None or arch.bos_token_id < arch.vocab_size,
           f"null or below vocab_size ({arch.vocab_size})")
    yield ("architecture.layer_types", arch.layer_types is None or len(arch.layer_types) == arch.num_layers,
           f"null or a list of num_layers ({arch.num_layers}) layer types")
    yield ("architecture.sliding_window", arch.sliding_window is not None
           or "sliding_attention" not in (arch.layer_types or []), "a positive integer where layer_types has "
                                                                      "sliding_attention layers")
    if quant.format == "int4_awq":
        yield "quantization.group_size", quant.group_size is not None, "a positive integer for format int4_awq"
        split = _split_int4_groups(arch, quant)
        yield ("quantization.group_size", not split,
               f"a divisor of the input features of every INT4 linear ({', '.join(split)})")


def _split_int4_groups(arch: Architecture, quant: QuantizationConfig) -> list[str]:
    """The input features of the INT4 linears that ``quant.group_size`` does not divide (Int4AwqLinear refuses
    them), as "name features"; a linear that ``exclude_modules`` keeps dense in every layer needs no groups."""
    inputs = {"self_attn.qkv_proj": arch.hidden_size, "self_attn.o_proj": arch.num_heads * arch.head_dim,
              "mlp.gate_up_proj": arch.hidden_size, "mlp.down_proj": arch.intermediate_size}
    return [f"{name} {features}" for name, features in inputs.items() if features % quant.group_size and not all(
        any(fnmatch(f"layers.{i}.{name}", pattern) for pattern in quant.exclude_modules)
        for i in range(arch.num_layers))]


# the keys that layers/rotary.py reads of each of its ROPE_TYPES' ``rope_scaling`` (others are kept, unread)
FACTORS: Rule = _list_of((is_number, "a finite number"))
ROPE_SCALING_RULES: dict[str, dict[str, Rule]] = {
    "default": {},
    "linear": {"factor": POSITIVE_NUMBER},
    "llama3": {"factor": POSITIVE_NUMBER, "low_freq_factor": POSITIVE_NUMBER, "high_freq_factor": POSITIVE_NUMBER,
               "original_max_position_embeddings": POSITIVE_INT},
    "longrope": {"short_factor": FACTORS, "long_factor": FACTORS, "attention_factor": NON_NEGATIVE_NUMBER,
                 "original_max_position_embeddings": POSITIVE_INT},
    "yarn": {"factor": POSITIVE_NUMBER, "beta_fast": POSITIVE_NUMBER, "beta_slow": POSITIVE_NUMBER, "truncate": FLAG,
             "attention_factor": NON_NEGATIVE_NUMBER, "original_max_position_embeddings": POSITIVE_INT},
}


def _rope_problem(arch: Architecture) -> str | None:
    """Why ``rope_scaling`` (an object or null) and ``rope_theta`` (a positive number) make no rotary table: a rope
    type without ROPE_SCALING_RULES (the builder writes ``rope_type``; RotaryEmbedding reads no other key for
    LongRoPE and YaRN), a key of its type that is missing or out of range, or frequencies that are not finite."""
    scaling = arch.rope_scaling or {}
    rope_type = scaling.get("rope_type") if scaling else "default"
    if type(rope_type) is not str or rope_type not in ROPE_SCALING_RULES:
        return (f"architecture.rope_scaling.rope_type must be one of {', '.join(ROPE_SCALING_RULES)}, got "
                f"{reprlib.repr(rope_type)}")
    for key, (check, requirement) in ROPE_SCALING_RULES[rope_type].items():
        if not check(scaling.get(key)):
            return (f"architecture.rope_scaling.{key} must be {requirement} for rope type {rope_type!r}, got "
                    f"{reprlib.repr(scaling.get(key))}")
    try:
        problem = frequency_problem(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    except ValueError as e:  # a math domain error the rules above let through
        problem = f"rope_scaling: {e}"
    return None if problem is None else f"architecture.{problem}"


TOP_LEVEL_KEYS = ("format", "format_version", "architecture", "dtype", "quantization", "plan", "fingerprint",
                  "parallel")


def _refuse_unknown(prefix: str, section: Any, known: set[str]) -> None:
    """EngineFormatError naming the first key of ``section`` this Kiln does not read: a newer Kiln's field, which
    could change what the engine computes, is never dropped."""
    if isinstance(section, dict) and (unknown := sorted(set(section) - known)):
        raise EngineFormatError(f"{prefix}{unknown[0]} is not a field this version of kiln reads: the engine was built "
                                f"by a newer kiln, and the field may change what it computes; load it with that kiln, "
                                f"or rebuild it with this one")


def _required(data: dict[str, Any], key: str) -> Any:
    if key not in data:
        raise EngineFormatError(f"missing key {key!r}")
    return data[key]


def _section_or_default(data: dict[str, Any], key: str) -> dict[str, Any]:
    """``data[key]`` when present (an object), else empty: a section that engines before it lack."""
    section = data.get(key, {})
    if not isinstance(section, dict):
        raise EngineFormatError(f"{key} is not an object")
    return section


def _plan(data: Any) -> BuildPlan:
    try:
        return BuildPlan.from_dict(data)
    except PlanError as e:
        raise EngineFormatError(f"plan: {e}") from None


def _section(cls: type, data: dict[str, Any], key: str) -> Any:
    """Construct dataclass ``cls`` from ``data[key]``; a key it does not know (a later writer's) is refused."""
    section = _required(data, key)
    if not isinstance(section, dict):
        raise EngineFormatError(f"{key} is not an object")
    _refuse_unknown(f"{key}.", section, {f.name for f in fields(cls)})
    try:
        return cls(**section)
    except TypeError as e:
        raise EngineFormatError(f"{key}: {e}") from None
