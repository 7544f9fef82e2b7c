"""The INT4-AWQ qkv projection of one token with RoPE and the KV store in its epilogue: one launch instead of two.

Each program of ``_int4_qkv_rotary_kernel`` owns pairs of rows d and d + head_dim / 2 of one head (``qkv_rotary``
describes the scheme) and streams both rows of each pair as the batch-1 ``int4_awq_gemv`` kernel streams its rows
(its steps of whole groups, its arithmetic: ``accumulate_int4_rows``), so q, K and V are bit for bit those of the
two launches it replaces. As for FP8 (``fp8_qkv_rotary``) at one token, the next kernel may launch only after the
loop: launched as the program starts, the step was slower on an H200 (2.492-2.500 against 2.470-2.473 ms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.kernels.int4_gemv import (
    ONE_BITS,
    accumulate_int4_rows,
    columns_of_words,
    int4_gemv_config,
    int4_gemv_operands,
    scaled_activation,
)
from kiln.runtime.native.kernels.kv_store import PagedCaches
from kiln.runtime.native.kernels.pdl import launch_next_kernel, pdl_options, wait_for_previous_kernel
from kiln.runtime.native.kernels.qkv_rotary import pair_rows, pairs_per_program, rotated_q, store_rotated_pairs
from kiln.runtime.native.kernels.rounding import TRITON_DTYPES, round_to_dtype


@triton.jit
def _int4_qkv_rotary_kernel(x_ptr, qw_ptr, scales_ptr, pqs_ptr, q_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr,
                            v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr, stride_kc_block, stride_kc_tok,
                            stride_kc_head, stride_vc_block, stride_vc_tok, stride_vc_head, stride_vc_dim, stride_qn,
                            stride_sn, stride_cos_sin, one, K: tl.constexpr, HALF: tl.constexpr,
                            Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DTYPE: tl.constexpr,
                            GROUP_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, GROUPS: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL, LAUNCH_NEXT=False)  # the next kernel launches after the loop
    WORDS: tl.constexpr = GROUPS * GROUP_SIZE // 8
    head, dims, rows = pair_rows(BLOCK_P, HALF)
    offs_w = tl.arange(0, WORDS)
    offs_g = tl.arange(0, GROUPS)
    cols = tl.arange(0, WORDS * 8)  # the step's input columns
    first_words = qw_ptr + rows.to(tl.int64)[:, None] * stride_qn
    second_words = first_words + HALF * stride_qn
    first_scales = scales_ptr + rows[:, None] * stride_sn
    second_scales = first_scales + HALF * stride_sn
    acc1 = tl.zeros((BLOCK_P,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for k0 in range(0, K, WORDS * 8):
        words = k0 // 8 + offs_w
        word_mask = (words < K // 8)[None, :]
        w1 = tl.load(first_words + words[None, :], mask=word_mask, other=0)
        w2 = tl.load(second_words + words[None, :], mask=word_mask, other=0)
        x = scaled_activation(x_ptr + k0 + cols, pqs_ptr + k0 + cols, cols < K - k0)
        columns = columns_of_words(x, WORDS)
        x_sum = tl.sum(tl.reshape(x, [GROUPS, GROUP_SIZE]), axis=1)
        groups = k0 // GROUP_SIZE + offs_g
        group_mask = (groups < K // GROUP_SIZE)[None, :]
        scale1 = tl.load(first_scales + groups[None, :], mask=group_mask, other=0.0)
        scale2 = tl.load(second_scales + groups[None, :], mask=group_mask, other=0.0)
        acc1 = accumulate_int4_rows(acc1, w1, scale1, columns, x_sum, one, GROUPS, GROUP_SIZE)
        acc2 = accumulate_int4_rows(acc2, w2, scale2, columns, x_sum, one, GROUPS, GROUP_SIZE)
    launch_next_kernel(PDL)
    offs_m = tl.arange(0, 1)
    x1 = round_to_dtype(acc1[None, :], DTYPE)  # as the linear stores them
    x2 = round_to_dtype(acc2[None, :], DTYPE)
    store_rotated_pairs(x1, x2, head, rows, dims, offs_m, offs_m < 1, q_ptr, 0, positions_ptr, cos_sin_ptr,
                        stride_cos_sin, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
                        stride_kc_block, stride_kc_tok, stride_kc_head, stride_vc_block, stride_vc_tok,
                        stride_vc_head, stride_vc_dim, HALF, Q_HEADS, KV_HEADS, DTYPE, BLOCK_SIZE, FP8)


def int4_qkv_rotary_config(n: int, k: int, group_size: int, head_dim: int) -> dict | None:
    """Launch parameters for one token of an [n, k] qkv projection, or None where no tile fits inside a head: the
    batch-1 ``int4_gemv_config`` tile as pairs (half its rows), halved until they divide head_dim / 2. Where the
    input features fill whole steps it runs on 4 warps: 7.2 us for Llama-3-8B's projection against 10.0 on 8,
    where the GEMV alone takes 6.7 and RoPE with the KV store 2.75 more (an H200, CUDA graphs). A mostly masked step
    keeps 8 warps (``fp8_qkv_rotary.qkv_rotary_config`` says why)."""
    cfg = int4_gemv_config(1, n, k, group_size)
    pairs = pairs_per_program(cfg.pop("BLOCK_N"), head_dim, 1)
    if pairs is None:
        return None
    if k % (cfg["GROUPS"] * group_size) == 0:
        cfg["num_warps"] = 4
    return dict(cfg, BLOCK_P=pairs)


def int4_qkv_rotary(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pre_quant_scale: torch.Tensor,
                    group_size: int, positions: torch.Tensor, cos_sin_cache: torch.Tensor, caches: PagedCaches,
                    num_heads: int, num_kv_heads: int, config: dict | None = None, pdl: bool = True) -> torch.Tensor:
    """A qkv projection of one token with RoPE and the KV store in one launch: x [1, K] and the INT4-AWQ weight as
    ``int4_awq_gemv`` takes them, its rows (num_heads + 2 * num_kv_heads) * head_dim, ``positions`` [1] (a row of
    ``cos_sin_cache`` [max_position, head_dim], float32). Returns q [1, num_heads, head_dim] rotated, in x's dtype,
    having stored the rotated K and the V at the slot of ``caches``. ``config``: ``int4_qkv_rotary_config``'s, where
    the caller has it already."""
    x2, qweight, scales, pre_quant_scale = int4_gemv_operands("int4_qkv_rotary", x, qweight, scales, pre_quant_scale,
                                                              group_size)
    (m, k), n = x2.shape, qweight.shape[0]
    if m != 1:
        raise ValueError(f"int4_qkv_rotary: takes one token, got {m}")
    q = rotated_q("int4_qkv_rotary", m, n, num_heads, num_kv_heads, positions, cos_sin_cache, x.dtype, x.device)
    head_dim = q.shape[-1]
    cfg = config or int4_qkv_rotary_config(n, k, group_size, head_dim)
    if cfg is None:
        raise ValueError(f"int4_qkv_rotary: no tile fits inside a head of {head_dim} dims")
    cache_args, cache_constexprs = caches.kernel_args()
    words = qweight.view(torch.int32)
    _int4_qkv_rotary_kernel[(n // 2 // cfg["BLOCK_P"],)](
        x2, words, scales, pre_quant_scale, q, positions, cos_sin_cache, *cache_args, words.stride(0),
        scales.stride(0), cos_sin_cache.stride(0), ONE_BITS, K=k, HALF=head_dim // 2, Q_HEADS=num_heads,
        KV_HEADS=num_kv_heads, DTYPE=TRITON_DTYPES[x.dtype], GROUP_SIZE=group_size, **cfg, **cache_constexprs,
        **pdl_options(x2, pdl))
    return q
