"""Rotary position embedding of q and k in one launch: the Triton twin of
``runtime.native.layers.rotary.RotaryEmbedding``.

One program per token reads its position's row of the float32 ``cos_sin_cache`` ([max_position, head_dim] =
cat(cos, sin)) once, rounds it to the model dtype as the layer does, and rotates every q head and every k head of
the token (GPT-NeoX half rotation: ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``). Each product and each sum
is rounded to the model dtype, as the separate PyTorch ops round them, so the result is bit-identical to the layer.
q and k may be strided views (the split of a fused qkv projection); the outputs are new contiguous tensors.

Given the layer's caches (``kv_store.CacheWrite``), the same program also writes the token's rotated K and its V
into the paged KV cache (the bytes ``kv_store.store_kv`` writes), so an attention layer with RoPE launches one kernel
before attending instead of two, and writes the rotated k only when a whole prompt attends over it directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.kernels.kv_store import CacheWrite, store_in_cache
from kiln.runtime.native.kernels.pdl import pdl_options, wait_for_previous_kernel
from kiln.runtime.native.kernels.rounding import SUPPORTED_DTYPES, multiply_rounded, round_to_dtype


@triton.jit
def rotate_halves(x1, x2, cos, sin, DTYPE: tl.constexpr):
    """``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` in float32 from float32 values of ``DTYPE``, every product
    and sum rounded to ``DTYPE`` as the layer's separate PyTorch ops round them (products never fused into an
    add, whatever the launch's ``enable_fp_fusion``)."""
    out1 = round_to_dtype(round_to_dtype(multiply_rounded(x1, cos), DTYPE)
                          - round_to_dtype(multiply_rounded(x2, sin), DTYPE), DTYPE)
    out2 = round_to_dtype(round_to_dtype(multiply_rounded(x2, cos), DTYPE)
                          + round_to_dtype(multiply_rounded(x1, sin), DTYPE), DTYPE)
    return out1, out2


@triton.jit
def _rotated_heads(x_ptr, token, cos, sin, stride_tok, stride_head, heads, dims, mask, HALF: tl.constexpr,
                   DTYPE: tl.constexpr):
    """The two rotated halves of one token's heads, [BLOCK_H, BLOCK_HALF] each, rounded to DTYPE (in float32);
    ``cos`` and ``sin`` are [1, BLOCK_HALF] in float32."""
    x1_ptrs = x_ptr + token * stride_tok + heads * stride_head + dims
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    return rotate_halves(x1, x2, cos, sin, DTYPE)


@triton.jit
def _store_halves(out_ptr, token, out1, out2, heads, dims, mask, NUM_HEADS: tl.constexpr, HALF: tl.constexpr):
    """Write rotated halves to row ``token`` of a contiguous [T, NUM_HEADS, 2 * HALF] output."""
    out_ptrs = out_ptr + token * (NUM_HEADS * 2 * HALF) + heads * (2 * HALF) + dims
    tl.store(out_ptrs, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptrs + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def cache_halves(cache_ptr, x1, x2, slot, heads, dims, mask, scale_ptr, stride_block, stride_tok, stride_head,
                 stride_dim, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    """``kv_store.store_in_cache`` of a token's two head halves (dims and dims + HALF)."""
    store_in_cache(cache_ptr, x1, slot, heads, dims, mask, scale_ptr, stride_block, stride_tok, stride_head,
                   stride_dim, BLOCK_SIZE, FP8)
    store_in_cache(cache_ptr, x2, slot, heads, dims + HALF, mask, scale_ptr, stride_block, stride_tok, stride_head,
                   stride_dim, BLOCK_SIZE, FP8)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr, v_ptr, stride_v_tok, stride_v_head,
                   k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr, stride_kc_block,
                   stride_kc_tok, stride_kc_head, stride_vc_block, stride_vc_tok, stride_vc_head, stride_vc_dim,
                   stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cache,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_KV_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, STORE: tl.constexpr, KEEP_K: tl.constexpr, FP8: tl.constexpr,
                   PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    cos_ptrs = cos_sin_ptr + position * stride_cache + half
    dtype = q_out_ptr.dtype.element_ty
    cos = round_to_dtype(tl.load(cos_ptrs, mask=half < HALF, other=0.0).to(tl.float32), dtype)[None, :]
    sin = round_to_dtype(tl.load(cos_ptrs + HALF, mask=half < HALF, other=0.0).to(tl.float32), dtype)[None, :]
    dims = half[None, :]
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    q1, q2 = _rotated_heads(q_ptr, token, cos, sin, stride_q_tok, stride_q_head, heads, dims, mask, HALF, dtype)
    _store_halves(q_out_ptr, token, q1, q2, heads, dims, mask, NUM_HEADS, HALF)
    heads = tl.arange(0, BLOCK_KV_H)[:, None]
    mask = (heads < NUM_KV_HEADS) & (dims < HALF)
    k1, k2 = _rotated_heads(k_ptr, token, cos, sin, stride_k_tok, stride_k_head, heads, dims, mask, HALF, dtype)
    if KEEP_K:
        _store_halves(k_out_ptr, token, k1, k2, heads, dims, mask, NUM_KV_HEADS, HALF)
    if STORE:  # the rotated K and the V of this token into the paged caches, as kv_store.store_kv writes them
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            v_ptrs = v_ptr + token * stride_v_tok + heads * stride_v_head + dims
            cache_halves(k_cache_ptr, k1.to(dtype), k2.to(dtype), slot, heads, dims, mask, k_scale_ptr,
                          stride_kc_block, stride_kc_tok, stride_kc_head, 1, HALF, BLOCK_SIZE, FP8)
            cache_halves(v_cache_ptr, tl.load(v_ptrs, mask=mask), tl.load(v_ptrs + HALF, mask=mask), slot, heads,
                          dims, mask, v_scale_ptr, stride_vc_block, stride_vc_tok, stride_vc_head, stride_vc_dim, HALF,
                          BLOCK_SIZE, FP8)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 cache_write: CacheWrite | None = None,
                 keep_k: bool = True, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] (same float dtype, any token and head
    strides) by ``positions`` [T] through ``cos_sin_cache`` [max_position, head_dim]. Returns new contiguous
    ``(q_out, k_out)``; positions are not bounds-checked.

    With ``cache_write``, the same launch also writes the rotated K and the V of each token into the paged caches,
    the bytes ``runtime.native.kernels.kv_store.store_kv`` writes from ``k_out``; without ``keep_k`` no ``k_out`` is
    made (None is returned in its place).
    """
    if q.dim() != 3 or k.dim() != 3 or positions.dim() != 1 or positions.is_floating_point():
        raise ValueError(f"apply_rotary: q and k must be [T, heads, head_dim] and positions integer [T], got q "
                         f"{list(q.shape)}, k {list(k.shape)}, positions {positions.dtype} {list(positions.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or positions.shape[0] != num_tokens:
        raise ValueError(f"apply_rotary: q, k and positions must have the same number of tokens, got "
                         f"{num_tokens}, {k.shape[0]} and {positions.shape[0]}")
    if k.shape[2] != head_dim or head_dim % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"apply_rotary: q, k and cos_sin_cache must share an even head_dim, got q {head_dim}, "
                         f"k {k.shape[2]}, cos_sin_cache {list(cos_sin_cache.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"apply_rotary: q and k must share a dtype among float32, float16 and bfloat16, got "
                         f"{q.dtype} and {k.dtype}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_sin_cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if keep_k or cache_write is None else None
    if num_tokens:
        num_kv_heads, half = k.shape[1], head_dim // 2
        store, constexprs = cache_write.kernel_args() if cache_write else CacheWrite.absent_args(q, positions)
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_sin_cache, q_out, q_out if k_out is None else k_out, *store, q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_KV_H=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=triton.next_power_of_2(half),
            STORE=cache_write is not None, KEEP_K=k_out is not None, **constexprs, num_warps=4,
            **pdl_options(q, pdl))
    return q_out, k_out
