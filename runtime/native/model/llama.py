"""Llama 2 / 3 (Llama-3 rotary scaling included) and Mistral's checkpoints without a sliding window shorter than
the engine's sequences: the plain decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.native.model.registry import Family


def quirks(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Llama's ``attention_bias`` puts biases on q, k, v and o; Mistral's ``sliding_window`` is recorded."""
    bias = bool(config.get("attention_bias"))
    return {"qkv_bias": bias, "o_bias": bias, "sliding_window": config.get("sliding_window")}


FAMILY = Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), quirks)
