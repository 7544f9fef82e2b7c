"""Qwen2 and Qwen2.5: biases on the q, k and v projections (none on o); a sliding window only when the config turns
it on with ``use_sliding_window``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.native.model.registry import Family, flag, sliding_layers


def quirks(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Always q/k/v biases; ``sliding_window`` counts only with ``use_sliding_window`` (the released models have it
    off and a window as long as their context)."""
    return {"qkv_bias": True, **window_layers(config, path)}


def window_layers(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """With ``use_sliding_window``, the layers from ``max_window_layers`` on slide (as transformers has it)."""
    window = config["sliding_window"] if flag(config, "use_sliding_window", path) else None
    first = config["max_window_layers"]
    return sliding_layers(config, path, window, lambda i: i >= first)


# transformers' defaults for Qwen2 and Qwen3
WINDOW_DEFAULTS = {"sliding_window": 4096, "max_window_layers": 28}
QWEN_DEFAULTS = {**WINDOW_DEFAULTS, "num_key_value_heads": 32, "max_position_embeddings": 32768}

FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), quirks, config_defaults=QWEN_DEFAULTS)
