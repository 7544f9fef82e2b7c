"""Mistral: the plain decoder with a sliding window over every layer and no biases (transformers' Mistral reads no
``attention_bias`` or ``mlp_bias``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.native.model.registry import Family, sliding_layers


def quirks(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """``sliding_window`` (4096 where config.json leaves it out, null for none) applies to every layer."""
    return sliding_layers(config, path, config["sliding_window"], lambda i: True)


FAMILY = Family("mistral", ("MistralForCausalLM",), quirks,
                config_defaults={"sliding_window": 4096, "num_key_value_heads": 8, "max_position_embeddings": 131072})
