"""Qwen2 and Qwen2.5: biases on the q, k and v projections (none on o); a sliding window only when the config turns
it on with ``use_sliding_window``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.native.model.registry import Family


def quirks(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Always q/k/v biases; ``sliding_window`` counts only with ``use_sliding_window`` (the released models have it
    off and a window as long as their context)."""
    return {"qkv_bias": True, "sliding_window": config.get("sliding_window") if config.get("use_sliding_window")
            else None}


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), quirks)
