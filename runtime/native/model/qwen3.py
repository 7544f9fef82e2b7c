"""Qwen3 (dense): an RMSNorm over each query and key head before the rotary embedding; biases only with
``attention_bias``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.native.model.qwen2 import QWEN_DEFAULTS, window_layers
from kiln.runtime.native.model.registry import Family, flag


def quirks(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Per-head q/k norms always; ``attention_bias`` puts biases on q, k, v and o, as in Llama."""
    bias = flag(config, "attention_bias", path)
    return {"qk_norm": True, "qkv_bias": bias, "o_bias": bias, **window_layers(config, path)}


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), quirks, config_defaults={**QWEN_DEFAULTS, "head_dim": 128})
