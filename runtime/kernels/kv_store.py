"""Store the new tokens' K/V into the paged caches: the Triton twin of ``runtime.layers.attention.store_kv``.

One program per token writes its K and V rows at ``slot_mapping[t]`` (flat slot = block * block_size + offset); a
negative slot is a padding token and writes nothing. Each cache is addressed through its strides, so a token-major V
cache (``runtime.kv_cache.token_major``) gets its values a token column at a time. An FP8 cache gets
``fp8_e4m3(clamp(x / scale, ±448))``, rounded to nearest-even exactly as torch does, so the stored bytes equal the
reference's; NaN is stored as 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.pdl import pdl_options, wait_for_previous_kernel
from runtime.kernels.rounding import quantize_e4m3
from runtime.kv_cache import is_token_major


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
                     stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_kc_block, stride_kc_tok,
                     stride_kc_head, stride_vc_block, stride_vc_tok, stride_vc_head, stride_vc_dim,
                     BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    if FP8:  # NaN is stored as 0: attention reads a block's stale slots past a sequence's end (kv_cache.py)
        k = quantize_e4m3(tl.where(k == k, k, 0.0), tl.load(k_scale_ptr))
        v = quantize_e4m3(tl.where(v == v, v, 0.0), tl.load(v_scale_ptr))
    k_offs = block * stride_kc_block + offset * stride_kc_tok + heads * stride_kc_head + dims
    v_offs = block * stride_vc_block + offset * stride_vc_tok + heads * stride_vc_head + dims * stride_vc_dim
    tl.store(k_cache_ptr + k_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write K/V [num_tokens, num_kv_heads, head_dim] at their flat slots; same contract as the reference."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("store_kv: an FP8 KV cache needs k_scale and v_scale")
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.is_contiguous()
    assert v_cache.is_contiguous() or is_token_major(v_cache)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), FP8=fp8,
        **pdl_options(k))
