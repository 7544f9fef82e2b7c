"""The native engine directory: ``engine.json`` (this module), ``rank0.safetensors`` and the tokenizer files.

``engine.json`` holds the model architecture, the compute dtype, the quantization, the build plan and the
fingerprint of the machine the engine was built for. Weights in ``rank0.safetensors`` are in runtime layout
(fused QKV and gate-up projections; see ``runtime/native/layers/linear.py`` for the quantized formats).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from kiln.runtime.errors import EngineFormatError
from kiln.runtime.native.model.registry import FAMILY_NAMES
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
        """Raise EngineFormatError when a value is outside what the runtime supports."""
        arch, plan = self.architecture, self.plan
        if (problem := architecture_size_problem(vars(arch))) is not None:  # before any arithmetic on the sizes
            raise EngineFormatError(f"architecture: {problem}")
        checks = [
            (arch.type in FAMILY_NAMES, f"architecture.type {arch.type!r} is not one of {', '.join(FAMILY_NAMES)}"),
            (self.dtype in DTYPES, f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}"),
            (self.quantization.format in QUANT_FORMATS, f"quantization.format {self.quantization.format!r} unknown"),
            (plan.kv_cache_dtype in KV_CACHE_DTYPES, f"plan.kv_cache_dtype {plan.kv_cache_dtype!r} unknown"),
            (arch.num_kv_heads > 0 and arch.num_heads % arch.num_kv_heads == 0,
             "architecture.num_heads is not a multiple of num_kv_heads"),
            (isinstance(self.fingerprint, dict), "fingerprint is not an object"),
            (type(self.tp_size) is int and self.tp_size >= 1, f"parallel.tp_size {self.tp_size!r} is not a positive "
                                                                f"integer"),
            (isinstance(self.quantization.fp8_streaming_max_m, dict) and all(
                isinstance(m, int) and m >= 0 for m in self.quantization.fp8_streaming_max_m.values()),
             "quantization.fp8_streaming_max_m is not an object of non-negative integers"),
        ]
        for ok, problem in checks:
            if not ok:
                raise EngineFormatError(problem)

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
