"""What the qkv projections with RoPE and the KV store in their epilogue share (``fp8_qkv_rotary``,
``int4_qkv_rotary``): one launch where a decode step would take two.

RoPE rotates dim d of a head with dim d + head_dim / 2, so each program owns ``BLOCK_P`` such pairs of rows within
one head (of q, then k, then v) of the fused projection (``pair_rows``). It streams both rows of each pair as its
format's GEMV streams rows, rounds the outputs to the model dtype as the linear stores them, and then, instead of
storing them, ``store_rotated_pairs`` rotates q and k by the tokens' positions, writes q, and stores the rotated K and
the V in the paged caches: what ``rotary.apply_rotary`` writes with a ``kv_store.CacheWrite`` from the linear's
output. Only the float32 summation order of the linear may differ (a program reduces half as many rows at a time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.kernels.rotary import cache_halves, rotate_halves
from kiln.runtime.native.kernels.rounding import SUPPORTED_DTYPES, round_to_dtype


@triton.jit
def pair_rows(BLOCK_P: tl.constexpr, HALF: tl.constexpr):
    """This program's head (q's, then k's, then v's), the dims of its pairs within the head's first half, and each
    pair's first weight row (the second is HALF rows on)."""
    pid = tl.program_id(0)
    head = pid * BLOCK_P // HALF
    dims = (pid * BLOCK_P) % HALF + tl.arange(0, BLOCK_P)
    return head, dims, head * (2 * HALF) + dims


@triton.jit
def store_rotated_pairs(x1, x2, head, rows, dims, offs_m, mask_m, q_ptr, stride_qm, positions_ptr, cos_sin_ptr,
                        stride_cos_sin, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
                        stride_kc_block, stride_kc_tok, stride_kc_head, stride_vc_block, stride_vc_tok,
                        stride_vc_head, stride_vc_dim, HALF: tl.constexpr, Q_HEADS: tl.constexpr,
                        KV_HEADS: tl.constexpr, DTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    """The epilogue of a program of ``pair_rows``: ``x1`` and ``x2`` [tokens, BLOCK_P] are its pairs' two rows for
    tokens ``offs_m`` (float32 values of DTYPE, as the linear stores them). q and k are rotated at the tokens'
    positions; q is written, K and V stored at each token's slot (negative: padding, not written)."""
    mask = tl.broadcast_to(mask_m[:, None], x1.shape)  # every pair is real: only padding tokens
    dims = dims[None, :]
    if head < Q_HEADS + KV_HEADS:
        position = tl.load(positions_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)[:, None]
        cos_ptrs = cos_sin_ptr + position * stride_cos_sin + dims
        cos = round_to_dtype(tl.load(cos_ptrs, mask=mask, other=0.0).to(tl.float32), DTYPE)
        sin = round_to_dtype(tl.load(cos_ptrs + HALF, mask=mask, other=0.0).to(tl.float32), DTYPE)
        x1, x2 = rotate_halves(x1, x2, cos, sin, DTYPE)
    if head < Q_HEADS:
        q_ptrs = q_ptr + offs_m[:, None] * stride_qm + rows[None, :]
        tl.store(q_ptrs, x1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(q_ptrs + HALF, x2.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)[:, None]
        mask = mask & (slot >= 0)
        if head < Q_HEADS + KV_HEADS:
            cache_halves(k_cache_ptr, x1.to(DTYPE), x2.to(DTYPE), slot, head - Q_HEADS, dims, mask, k_scale_ptr,
                         stride_kc_block, stride_kc_tok, stride_kc_head, 1, HALF, BLOCK_SIZE, FP8)
        else:
            cache_halves(v_cache_ptr, x1.to(DTYPE), x2.to(DTYPE), slot, head - Q_HEADS - KV_HEADS, dims, mask,
                         v_scale_ptr, stride_vc_block, stride_vc_tok, stride_vc_head, stride_vc_dim, HALF,
                         BLOCK_SIZE, FP8)


def pairs_per_program(rows: int, head_dim: int, least: int) -> int | None:
    """A GEMV tile of ``rows`` weight rows as pairs (half as many), halved until they divide head_dim / 2: a
    program's pairs then lie within one head. None below ``least`` (a ``tl.dot`` tile needs 16)."""
    pairs = rows // 2
    while pairs >= least and (head_dim % 2 or (head_dim // 2) % pairs):
        pairs //= 2
    return pairs if pairs >= least else None


def rotated_q(caller: str, m: int, n: int, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
              cos_sin_cache: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The q [m, num_heads, head_dim] that a launch over an [n, K] qkv weight fills, its operands checked."""
    head_dim = n // (num_heads + 2 * num_kv_heads)
    if n != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"{caller}: {n} weight rows are not {num_heads} q and 2 x {num_kv_heads} kv heads")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{caller}: the output must be float32, float16 or bfloat16, got {dtype}")
    if positions.shape != (m,) or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(-1) != 1:
        raise ValueError(f"{caller}: needs {m} positions and a [max_position, {head_dim}] cos_sin_cache "
                         f"with a unit last stride, got {list(positions.shape)} and {list(cos_sin_cache.shape)}")
    return torch.empty(m, num_heads, head_dim, dtype=dtype, device=device)

