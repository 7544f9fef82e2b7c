"""The model families the native engine runs, keyed by the ``architectures`` entry of a Hugging Face config.json.

Every family runs on the one decoder (``decoder.py``) built from the shared layers; a family file says which
checkpoints are its own and reads its quirks from their config.json into ``Architecture`` fields. Adding a family
is one file beside the others, listed in ``FAMILIES``, plus its tests (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.runtime.errors import KilnError
from kiln.runtime.json_files import is_number


class UnsupportedArchitectureError(KilnError):
    """A checkpoint whose family the native engine does not run, or a quirk of it that is not built yet."""


# the checkpoint's linears that make each of the runtime's, in order (their rows are concatenated)
SEPARATE_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


@dataclass(frozen=True)
class Family:
    """``name`` is engine.json's ``architecture.type``; ``quirks(config, path)`` returns the ``Architecture`` fields
    particular to the family from a parsed config.json (``path`` names it in errors), raising
    UnsupportedArchitectureError for what the engine cannot honour; ``linears`` maps each runtime linear of a layer
    to the checkpoint linears it fuses; ``norm_weight_offset`` is added to the checkpoint's norm weights.

    ``config_defaults`` are the values of transformers' config class for the fields the family reads where they
    differ from ``SHARED_CONFIG_DEFAULTS``, so that a field config.json leaves out means what it means to
    transformers; ``activation_key`` is the field that names the MLP's activation; ``rope_types``, where the config
    class takes only some RoPE types, maps each name it takes to the type it means (None: every supported one);
    ``partial_rotary``: its plain RoPE applies ``partial_rotary_factor`` (else transformers ignores it there);
    ``unsupported_dtypes``: model dtypes the family cannot run in, each with why."""

    name: str
    architectures: tuple[str, ...]
    quirks: Callable[[dict[str, Any], Path], dict[str, Any]]
    linears: dict[str, tuple[str, ...]] = field(default_factory=lambda: SEPARATE_PROJECTIONS)
    norm_weight_offset: float = 0.0  # added to every RMSNorm weight of the checkpoint (Gemma scales by 1 + weight)
    config_defaults: dict[str, Any] = field(default_factory=dict)
    activation_key: str = "hidden_act"
    rope_types: dict[str, str] | None = None
    partial_rotary: bool = False
    unsupported_dtypes: dict[str, str] = field(default_factory=dict)

    def with_defaults(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` (a parsed config.json) with the family's transformers defaults where it has no such field;
        an explicit null stays null, as in transformers."""
        return {**SHARED_CONFIG_DEFAULTS, **self.config_defaults, **config}


# transformers' defaults that the config classes of every supported family share
SHARED_CONFIG_DEFAULTS: dict[str, Any] = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                          "tie_word_embeddings": False}


def _families() -> tuple[Family, ...]:
    from kiln.runtime.native.model import gemma2, llama, mistral, phi3, qwen2, qwen3

    return llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma2.FAMILY, phi3.FAMILY


def family_of(config: dict[str, Any], path: Path) -> Family:
    """The family of a parsed config.json by its first ``architectures`` entry, or without one by its
    ``model_type`` (as transformers' Auto classes find it; each family is named as its model_type); refused naming
    the supported ones."""
    architectures = config.get("architectures") or []
    if architectures:
        name, found = repr(architectures[0]), [f for f in FAMILIES if architectures[0] in f.architectures]
    else:
        name, found = f"model_type {config.get('model_type')!r}", [f for f in FAMILIES
                                                                   if f.name == config.get("model_type")]
    if not found:
        raise UnsupportedArchitectureError(
            f"{path}: architecture {name} is not supported by the native backend (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    return found[0]


def family_named(name: str) -> Family:
    """The family whose ``name`` an engine.json records."""
    return next(family for family in FAMILIES if family.name == name)


LAYER_TYPES = ("full_attention", "sliding_attention")  # config.json layer_types the engine runs


def sliding_layers(config: dict[str, Any], path: Path, window: int | None,
                   slides: Callable[[int], bool]) -> dict[str, Any]:
    """The ``sliding_window`` / ``layer_types`` fields: none without a ``window`` (None); else config.json's
    ``layer_types`` when it has them (transformers 5 writes them), or ``slides(layer index)`` for each layer.
    KilnError for a window that is not a positive integer (transformers' sliding layers fail on 0);
    UnsupportedArchitectureError for ``layer_types`` that do not name full or sliding attention for every layer
    (transformers refuses those too)."""
    if window is None:
        return {"sliding_window": None, "layer_types": None}
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise KilnError(f"{path}: sliding_window must be a positive integer or null (no window), got {window!r}")
    count = config["num_hidden_layers"]
    types = config.get("layer_types") or ["sliding_attention" if slides(i) else "full_attention" for i in range(count)]
    if not isinstance(types, list) or len(types) != count or not set(types) <= set(LAYER_TYPES):
        raise UnsupportedArchitectureError(
            f"{path}: layer_types {types!r} must name one of {', '.join(LAYER_TYPES)} for each of the {count} layers "
            f"(num_hidden_layers); the native backend runs no other attention")
    return {"sliding_window": window, "layer_types": list(types)}


def positive_number(value: Any, key: str, path: Path) -> float:
    """``value`` of config.json's ``key`` as a float; KilnError naming it unless it is a positive number."""
    if not is_number(value) or value <= 0:
        raise KilnError(f"{path}: {key} must be a positive number, got {value!r}")
    return float(value)


def flag(config: dict[str, Any], key: str, path: Path) -> bool:
    """config.json's ``key`` as a bool (absent or null: False); KilnError naming it unless it is true or false (a
    string "false" would read as true)."""
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise KilnError(f"{path}: {key} must be true or false, got {value!r}")
    return bool(value)


# last: the family files import what is above
FAMILIES = _families()
FAMILY_NAMES = tuple(family.name for family in FAMILIES)
SUPPORTED_ARCHITECTURES = tuple(arch for family in FAMILIES for arch in family.architectures)
