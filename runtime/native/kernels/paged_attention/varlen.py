"""Causal paged attention of any flat batch (prefill, chunked prefill, prefix-cache hits, decode): one program per
(query tile of a sequence, KV head), each K/V tile read once for the tile's tokens times the GQA group."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.kernels.paged_attention.operands import (
    LOG2E,
    check_operands,
    dot_precision,
    fp16_compute,
    output_for,
)
from kiln.runtime.native.kernels.paged_attention.tiles import attend_range, kv_scales, load_q, store_out
from kiln.runtime.native.kernels.paged_attention.tiling import VARLEN_TILES
from kiln.runtime.native.kernels.pdl import pdl_options, wait_for_previous_kernel


# Arguments that vary from step to step are not specialised on (divisibility by 16, equality to 1): each new
# specialisation is a compile in the middle of serving.
@triton.jit(do_not_specialize=["stride_bt", "first_seq"])
def _varlen_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
                   k_scale_ptr, v_scale_ptr, quant_scale_ptr, scale_log2, stride_q_tok, stride_q_head, stride_o_tok,
                   stride_o_head, stride_c_block, stride_c_tok, stride_c_head, stride_v_block, stride_v_head,
                   stride_v_dim, stride_bt, first_seq, window, softcap_log2, GROUP: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, FP8: tl.constexpr, FP16: tl.constexpr, PRECISION: tl.constexpr,
                   V_TOKEN_MAJOR: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr, WINDOWED: tl.constexpr,
                   SOFTCAPPED: tl.constexpr):
    wait_for_previous_kernel(PDL)
    TOKENS: tl.constexpr = BLOCK_M // GROUP  # query tokens per program; each brings its GROUP heads as rows
    kv_head = tl.program_id(0)
    q_tile = tl.program_id(1)
    seq = tl.program_id(2) + first_seq
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * TOKENS >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * TOKENS + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows < TOKENS * GROUP) & (tok < q_len)
    pos = context + tok
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    q_tok = (q_start + tok).to(tl.int64)
    q = load_q(q_ptr + q_tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
               row_mask[:, None] & d_mask[None, :], FP16)
    qk_scale, out_scale = kv_scales(k_scale_ptr, v_scale_ptr, scale_log2, FP8)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite, so a fully masked row never makes NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_M] if V_TOKEN_MAJOR else [BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, context + tl.minimum(q_len, (q_tile + 1) * TOKENS))  # causal: last row's position
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    all_visible_end = context + q_tile * TOKENS + 1  # the tile's first row sees the tokens up to its own
    kv_start = 0
    if WINDOWED:  # the tile's first row sees nothing before its window
        kv_start = tl.maximum(context + q_tile * TOKENS - window + 1, 0) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = attend_range(q, pos, m_i, l_i, acc, kv_start, kv_end, all_visible_end, k_cache_ptr, v_cache_ptr,
                                 block_table_row, dims, d_mask, kv_head, qk_scale, stride_c_block, stride_c_tok,
                                 stride_c_head, stride_v_block, stride_v_head, stride_v_dim, BLOCK_SIZE, BLOCK_N,
                                 True, False, V_TOKEN_MAJOR, PRECISION, window=window, softcap_log2=softcap_log2,
                                 WINDOWED=WINDOWED, SOFTCAPPED=SOFTCAPPED)

    out = acc * (out_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    store_out(out_ptr + q_tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :], out,
              row_mask[:, None] & d_mask[None, :], quant_scale_ptr, q_ptr.dtype.element_ty, QUANT)


def paged_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, block_m: int = 64, block_n: int | None = None,
                           num_warps: int = 4, num_stages: int | None = None, first_seq: int = 0,
                           quant_scale: torch.Tensor | None = None, pdl: bool = True, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Causal paged attention of any flat batch: q [T, num_heads, head_dim] -> [T, num_heads, head_dim], in q's
    dtype, or with ``quant_scale`` (float32 []) float8_e4m3fn quantized with it for the next FP8 linear; over the
    last ``window`` positions of each token and with soft-capped scores when given (``paged_attention_reference``).

    Only sequences ``first_seq`` on are attended: ``out`` (optional, preallocated, the shape and dtype returned)
    gets their rows, which are all of q's when ``first_seq`` is 0; ``block_m`` rows per program
    (query tokens times the GQA group) and ``block_n`` KV tokens per tile are powers of two, at least 16
    (``block_n`` and ``num_stages`` default to ``VARLEN_TILES``).
    """
    fp8, v_token_major = check_operands(q, k_cache, v_cache, k_scale, v_scale)
    block_n = block_n or VARLEN_TILES[fp8]["block_n"]
    num_stages = num_stages or VARLEN_TILES[fp8]["num_stages"]
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_m = max(block_m, triton.next_power_of_2(group), 16)
    out = output_for(q, quant_scale) if out is None else out
    num_seqs = meta.seq_lens.shape[0] - first_seq
    grid = (num_kv_heads, triton.cdiv(meta.max_query_len, block_m // group), num_seqs)
    _varlen_kernel[grid](
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        k_scale if fp8 else q, v_scale if fp8 else q, q if quant_scale is None else quant_scale, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(2), v_cache.stride(3), meta.block_tables.stride(0),
        first_seq, window or 0, (softcap or 1.0) * LOG2E, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=max(block_n, 16),
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16), FP8=fp8, FP16=fp16_compute(q, fp8),
        PRECISION=dot_precision(q), V_TOKEN_MAJOR=v_token_major, QUANT=quant_scale is not None, num_warps=num_warps,
        num_stages=num_stages, WINDOWED=window is not None, SOFTCAPPED=softcap is not None, **pdl_options(q, pdl))
    return out
