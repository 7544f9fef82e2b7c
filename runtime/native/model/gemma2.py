"""Gemma 2: RMSNorm by ``1 + weight``, norms before and after both attention and the MLP, GeGLU with tanh GELU,
embeddings scaled by sqrt(hidden_size), the attention scale from ``query_pre_attn_scalar``, soft-capped attention
and final logits, a sliding window on every other layer (the first included), tied embeddings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.native.model.registry import Family, sliding_layers


def quirks(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Every Gemma 2 quirk from its config.json (transformers' defaults where it omits one)."""
    return {
        "hidden_act": config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh",
        "sandwich_norms": True,
        "scale_embeddings": True,
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcapping": config.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": config.get("final_logit_softcapping", 30.0),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
        **sliding_layers(config, config.get("sliding_window", 4096), lambda i: i % 2 == 0),
    }


FAMILY = Family("gemma2", ("Gemma2ForCausalLM",), quirks, norm_weight_offset=1.0)
