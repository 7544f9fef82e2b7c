"""Llama 2 / 3 (Llama-3 rotary scaling included) and Mistral (a sliding window over every layer): the plain
decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.native.model.registry import Family, sliding_layers


def quirks(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Llama's ``attention_bias`` puts biases on q, k, v and o, its ``mlp_bias`` on gate, up and down; Mistral's
    ``sliding_window`` applies to every layer."""
    bias = bool(config.get("attention_bias"))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(config.get("mlp_bias")),
            **sliding_layers(config, config.get("sliding_window"), lambda i: True)}


FAMILY = Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), quirks)
