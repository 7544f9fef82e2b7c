"""Gemma 2: RMSNorm by ``1 + weight``, norms before and after both attention and the MLP, GeGLU with tanh GELU,
embeddings scaled by sqrt(hidden_size), the attention scale from ``query_pre_attn_scalar``, soft-capped attention
and final logits, a sliding window on every other layer (the first included), tied embeddings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.native.model.registry import Family, flag, positive_number, sliding_layers


def quirks(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Every Gemma 2 quirk from its config.json (transformers' defaults where it omits one); ``attention_bias`` puts
    biases on q, k, v and o."""
    bias = flag(config, "attention_bias", path)
    return {
        "sandwich_norms": True,
        "scale_embeddings": True,
        "query_pre_attn_scalar": positive_number(config["query_pre_attn_scalar"], "query_pre_attn_scalar", path),
        "attn_logit_softcapping": _softcap(config, "attn_logit_softcapping", path),
        "final_logit_softcapping": _softcap(config, "final_logit_softcapping", path),
        "qkv_bias": bias,
        "o_bias": bias,
        **sliding_layers(config, path, config["sliding_window"], lambda i: i % 2 == 0),
    }


def _softcap(config: dict[str, Any], key: str, path: Path) -> float | None:
    """A soft cap of config.json: a positive number, or null for none (a cap of 0 divides by zero)."""
    return None if config[key] is None else positive_number(config[key], f"{key} (null: no cap)", path)


FAMILY = Family("gemma2", ("Gemma2ForCausalLM",), quirks, norm_weight_offset=1.0, activation_key="hidden_activation",
                config_defaults={"hidden_activation": "gelu_pytorch_tanh", "head_dim": 256, "num_key_value_heads": 4,
                                 "max_position_embeddings": 8192, "tie_word_embeddings": True,
                                 "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                                 "final_logit_softcapping": 30.0, "sliding_window": 4096},
                unsupported_dtypes={"float16": "its activations overflow float16 (as vLLM refuses it: numerical "
                                               "instability)"})
