"""What the paged-attention wrappers check and derive from their operands: the cache layout, the compute dtype and
the output tensor."""

from __future__ import annotations

import torch

from kiln.runtime.native.kv_cache import is_token_major

LOG2E = 1.4426950408889634


def check_operands(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None) -> tuple[bool, bool]:
    """Validate the layout the kernels assume; return whether the cache is FP8 and whether V is token-major."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"paged_attention: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    v_token_major = is_token_major(v_cache)
    if q.stride(-1) != 1 or not k_cache.is_contiguous() or not (v_cache.is_contiguous() or v_token_major):
        raise ValueError("paged_attention: q needs a unit last stride, the K cache must be contiguous and the V "
                         "cache contiguous or token-major (runtime.native.kv_cache.token_major)")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("paged_attention: an FP8 KV cache needs k_scale and v_scale")
    return fp8, v_token_major


def dot_precision(q: torch.Tensor) -> str:
    """The ``tl.dot`` input precision: IEEE for a float32 model (no TF32 rounding), else TF32 (unused by 16-bit
    operands)."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def fp8_pv_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether decode can multiply p @ v in FP8 here: an FP8 cache with V token-major, and a 16-bit q."""
    return k_cache.dtype == torch.float8_e4m3fn and is_token_major(v_cache) and q.dtype != torch.float32


def fp16_compute(q: torch.Tensor, fp8: bool) -> bool:
    """Whether a 16-bit model attends an FP8 cache in float16: E4M3 converts to it exactly and natively, and the
    probabilities keep three more bits than in bfloat16."""
    return fp8 and q.dtype != torch.float32


def output_for(q: torch.Tensor, quant_scale: torch.Tensor | None) -> torch.Tensor:
    """The attention output: q's shape, in q's dtype or, quantized for an FP8 linear, float8_e4m3fn."""
    return torch.empty(q.shape, dtype=q.dtype if quant_scale is None else torch.float8_e4m3fn, device=q.device)
