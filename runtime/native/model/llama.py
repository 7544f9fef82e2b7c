"""Llama 2 / 3 (Llama-3 rotary scaling included): the plain decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.native.model.registry import Family, flag


def quirks(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """``attention_bias`` puts biases on q, k, v and o, ``mlp_bias`` on gate, up and down. Transformers' Llama has
    no sliding window, so a ``sliding_window`` in its config.json changes nothing here either."""
    bias = flag(config, "attention_bias", path)
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": flag(config, "mlp_bias", path)}


FAMILY = Family("llama", ("LlamaForCausalLM",), quirks, config_defaults={"max_position_embeddings": 2048})
