"""The FP8 qkv projection of a few tokens with RoPE and the KV store in its epilogue: one launch instead of two.

Each program of ``_qkv_rotary_kernel`` owns pairs of rows d and d + head_dim / 2 of one head (``qkv_rotary``
describes the scheme) and streams both rows of each pair against the FP8 activation as ``fp8_gemv`` does (its tiles,
its accumulation).

A decode step loses one launch a layer. On an H200 (Llama-3-8B, FP8, CUDA graphs) that made steps of 1-8 sequences
4-7 % faster and of 16 2.5 % (docs/performance.md). With one token a program lets the next kernel launch only after
its loop: launched as it starts, the attention's waiting programs took room from this one's (2.764 against 2.735
ms a step); with more tokens the early launch is worth more (3.00 against 3.40 ms at 2 sequences).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.kernels.fp8_gemv import accumulate_rows, fitting_stages, fp8_gemv_config, fp8_gemv_operands
from kiln.runtime.native.kernels.kv_store import PagedCaches
from kiln.runtime.native.kernels.pdl import launch_next_kernel, pdl_options, wait_for_previous_kernel
from kiln.runtime.native.kernels.qkv_rotary import pair_rows, pairs_per_program, rotated_q, store_rotated_pairs
from kiln.runtime.native.kernels.rounding import TRITON_DTYPES, round_to_dtype


@triton.jit
def _qkv_rotary_kernel(x_ptr, w_ptr, w_scale_ptr, input_scale_ptr, q_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr,
                       v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr, stride_kc_block, stride_kc_tok,
                       stride_kc_head, stride_vc_block, stride_vc_tok, stride_vc_head, stride_vc_dim, M,
                       stride_xm, stride_wn, stride_qm, stride_cos_sin, K: tl.constexpr, HALF: tl.constexpr,
                       Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, FP8_DOT: tl.constexpr,
                       LAUNCH_NEXT_EARLY: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
                       PDL: tl.constexpr):
    wait_for_previous_kernel(PDL, LAUNCH_NEXT_EARLY)
    head, dims, rows = pair_rows(BLOCK_P, HALF)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    first_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    second_ptrs = first_ptrs + HALF * stride_wn
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc1 = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        w1 = tl.load(first_ptrs, mask=mask_k[None, :], other=0.0)
        w2 = tl.load(second_ptrs, mask=mask_k[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc1 = accumulate_rows(acc1, w1, x, BLOCK_M, FP8_DOT)
        acc2 = accumulate_rows(acc2, w2, x, BLOCK_M, FP8_DOT)
        first_ptrs += BLOCK_K
        second_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not LAUNCH_NEXT_EARLY:
        launch_next_kernel(PDL)
    input_scale = tl.load(input_scale_ptr)
    x1 = round_to_dtype(acc1 * (tl.load(w_scale_ptr + rows) * input_scale)[None, :], DTYPE)  # as the linear
    x2 = round_to_dtype(acc2 * (tl.load(w_scale_ptr + rows + HALF) * input_scale)[None, :], DTYPE)  # stores them
    store_rotated_pairs(x1, x2, head, rows, dims, offs_m, mask_m, q_ptr, stride_qm, positions_ptr, cos_sin_ptr,
                        stride_cos_sin, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
                        stride_kc_block, stride_kc_tok, stride_kc_head, stride_vc_block, stride_vc_tok,
                        stride_vc_head, stride_vc_dim, HALF, Q_HEADS, KV_HEADS, DTYPE, BLOCK_SIZE, FP8)


def qkv_rotary_config(m: int, n: int, k: int, head_dim: int) -> dict | None:
    """Launch parameters for m tokens of an [n, k] qkv projection, or None where no tile fits inside a head.
    ``fp8_gemv``'s tile as pairs (half its rows), halved until they divide head_dim / 2 (a ``tl.dot`` needs 16),
    letting the next kernel launch after its loop for one token (module docstring). One token whose input features
    fill whole chunks runs on 4 warps: 6.3 us for Llama-3-8B's projection against 7.6 on 8, and 6.6 for
    ``fp8_gemv`` alone (an H200, CUDA graphs). Compiled for sm_90 by triton 3.6, a 4-warp program whose chunk is
    mostly masked (128 or 1024 input features in 4096 columns) sums some rows wrongly, by up to 0.125 on integer
    operands, where 8 warps and whole chunks are exact (measured on an H200, 2026-12-04)."""
    cfg = fp8_gemv_config(m, n, k)
    pairs = pairs_per_program(cfg.pop("BLOCK_N"), head_dim, 1 if m == 1 else 16)
    if pairs is None:
        return None
    if m == 1 and k % cfg["BLOCK_K"] == 0:
        cfg["num_warps"] = 4
    return dict(cfg, BLOCK_P=pairs, LAUNCH_NEXT_EARLY=m > 1)


def fp8_qkv_rotary(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
                   positions: torch.Tensor, cos_sin_cache: torch.Tensor, caches: PagedCaches, num_heads: int,
                   num_kv_heads: int, out_dtype: torch.dtype | None = None, config: dict | None = None,
                   pdl: bool = True) -> torch.Tensor:
    """A qkv projection with RoPE and the KV store in one launch: x [T, K] as ``fp8_gemv`` takes it, weight
    float8_e4m3fn [(num_heads + 2 * num_kv_heads) * head_dim, K] with its scales, ``positions`` [T] (rows of
    ``cos_sin_cache`` [max_position, head_dim], float32). Returns q [T, num_heads, head_dim] rotated, in the model
    dtype (``out_dtype``, default x.dtype), having stored the rotated K and the V at the slots of ``caches``.
    ``config``: ``qkv_rotary_config``'s, where the caller has it already."""
    m, n, dtype = x.numel() // max(x.shape[-1], 1), weight.shape[0], out_dtype or x.dtype
    q = rotated_q("fp8_qkv_rotary", m, n, num_heads, num_kv_heads, positions, cos_sin_cache, dtype, x.device)
    x_q, weight = fp8_gemv_operands("fp8_qkv_rotary", x, weight, input_scale, out_dtype, pdl)  # after the checks
    k = x_q.shape[1]
    head_dim = q.shape[-1]
    cfg = config or qkv_rotary_config(m, n, k, head_dim)
    if cfg is None:
        raise ValueError(f"fp8_qkv_rotary: no tile for {m} tokens fits inside a head of {head_dim} dims "
                         "(see qkv_rotary_config)")
    cfg = fitting_stages(cfg, x.device)
    if m:
        cache_args, cache_constexprs = caches.kernel_args()
        grid = (n // 2 // cfg["BLOCK_P"], triton.cdiv(m, cfg["BLOCK_M"]))
        _qkv_rotary_kernel[grid](
            x_q, weight, weight_scale, input_scale.reshape(()), q, positions, cos_sin_cache, *cache_args, m,
            x_q.stride(0), weight.stride(0), q.stride(0), cos_sin_cache.stride(0), K=k, HALF=head_dim // 2,
            Q_HEADS=num_heads, KV_HEADS=num_kv_heads, DTYPE=TRITON_DTYPES[dtype], FP8_DOT=x.is_cuda, **cfg,
            **cache_constexprs, **pdl_options(x_q, pdl))
    return q
