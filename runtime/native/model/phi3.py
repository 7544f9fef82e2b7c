"""Phi-3 (the dense Phi3ForCausalLM: mini, medium): the checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as
one ``gate_up_proj``, already in the runtime's fused layout; the 128k models scale RoPE with ``longrope``
(``layers/rotary.py``), the 4k ones use plain RoPE and a sliding window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.native.model.registry import Family, sliding_layers

FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.qkv_proj",),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_up_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}


def quirks(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Phi-3's window (2047 on the 4k models) applies to every layer."""
    # transformers' Phi-3 slides every layer, whatever a layer_types list in config.json says
    return sliding_layers({**config, "layer_types": None}, path, config.get("sliding_window"), lambda i: True)


# transformers' Phi3Config: plain RoPE or LongRoPE, which "su" and "yarn" name too (its first names for it)
ROPE_TYPES = {"default": "default", "longrope": "longrope", "su": "longrope", "yarn": "longrope"}

FAMILY = Family("phi3", ("Phi3ForCausalLM",), quirks, FUSED_PROJECTIONS,
                config_defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                                 "original_max_position_embeddings": 4096}, rope_types=ROPE_TYPES,
                partial_rotary=True)
