"""Split-KV decode (flash-decoding): one program per (sequence, KV head, partition) writes a partial max, sum and
unnormalised output, and a second kernel combines each (sequence, head)'s partitions; one partition writes the output
itself, and in a small decode graph's step of two partitions the last of them to finish combines both."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.kernels.paged_attention.operands import (
    LOG2E,
    check_operands,
    dot_precision,
    fp8_pv_applies,
    fp16_compute,
    output_for,
)
from kiln.runtime.native.kernels.paged_attention.tiles import P_SCALE, attend_range, kv_scales, load_q, store_out
from kiln.runtime.native.kernels.paged_attention.tiling import (
    DECODE_TILES,
    combine_partitions,
    decode_block_n,
    decode_partition_size,
)
from kiln.runtime.native.kernels.pdl import pdl_options, wait_for_previous_kernel
from kiln.runtime.native.kernels.rounding import TRITON_DTYPES


@triton.jit
def _chunk(seq_len, num_splits, PARTITION_SIZE: tl.constexpr, CHUNK_ALIGN: tl.constexpr):
    """Tokens per partition of a context of ``seq_len``: split into ``num_splits`` (the grid's) partitions of a
    multiple of CHUNK_ALIGN, at most PARTITION_SIZE, so that a short context in a grid sized for long ones is
    still spread over the programs."""
    return tl.minimum(tl.cdiv(tl.cdiv(seq_len, num_splits), CHUNK_ALIGN) * CHUNK_ALIGN, PARTITION_SIZE)


@triton.jit
def _first_half_rows(x):
    """Rows 0 .. R/2 of x [R, D] (R a power of two, at least 2)."""
    first, _ = tl.split(tl.permute(tl.reshape(x, [2, x.shape[0] // 2, x.shape[1]]), (1, 2, 0)))
    return first


@triton.jit
def _leading_rows(x, ROWS: tl.constexpr):
    """Rows 0 .. ROWS of x [R, D] (ROWS a power of two dividing R, R at most 16 ROWS)."""
    if x.shape[0] > ROWS:
        x = _first_half_rows(x)
    if x.shape[0] > ROWS:
        x = _first_half_rows(x)
    if x.shape[0] > ROWS:
        x = _first_half_rows(x)
    if x.shape[0] > ROWS:
        x = _first_half_rows(x)
    return x


@triton.jit(do_not_specialize=["stride_bt", "max_partitions"])
def _decode_partition_kernel(q_ptr, k_cache_ptr, v_cache_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
                             query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
                             quant_scale_ptr, counters_ptr, scale_log2, stride_q_tok, stride_q_head, stride_o_tok,
                             stride_o_head, stride_c_block, stride_c_tok, stride_c_head, stride_v_block, stride_v_head,
                             stride_v_dim, stride_bt, num_heads, max_partitions, window, softcap_log2,
                             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             PARTITION_SIZE: tl.constexpr, FP8: tl.constexpr, FP16: tl.constexpr,
                             PRECISION: tl.constexpr,
                             V_TOKEN_MAJOR: tl.constexpr, PARTITION_BLOCKS: tl.constexpr, CHUNK_ALIGN: tl.constexpr,
                             LONE: tl.constexpr, QUANT: tl.constexpr, GROUP_ROWS: tl.constexpr, PDL: tl.constexpr,
                             WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr, COMBINE: tl.constexpr,
                             BLOCK_P: tl.constexpr, FP8_PV: tl.constexpr):
    wait_for_previous_kernel(PDL)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = _chunk(seq_len, max_partitions, PARTITION_SIZE, CHUNK_ALIGN)
    start = part * chunk
    if start >= seq_len:
        return
    end = tl.minimum(start + chunk, seq_len)

    rows = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    q_tok = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q = load_q(q_ptr + q_tok * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
               row_mask[:, None] & d_mask[None, :], FP16)
    qk_scale, out_scale = kv_scales(k_scale_ptr, v_scale_ptr, scale_log2, FP8)
    if FP8_PV:
        out_scale = out_scale / P_SCALE

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # the partition's block numbers, read once: K/V addresses then depend on no load inside the loop, so the
    # compiler can prefetch the next tile while this one is computed (an H200 decodes ~10 % faster with FP8 KV)
    first_block = start // BLOCK_SIZE
    entries = first_block + tl.arange(0, PARTITION_BLOCKS)
    blocks = tl.load(block_table_row + entries, mask=entries * BLOCK_SIZE < end, other=0)
    # the one query is the last position: every cached token is visible (within its window, when WINDOWED)
    acc = tl.zeros([BLOCK_D, BLOCK_G] if V_TOKEN_MAJOR else [BLOCK_G, BLOCK_D], dtype=tl.float32)
    pos = tl.zeros([BLOCK_G], dtype=tl.int32) + seq_len - 1
    kv_start = start
    if WINDOWED:  # a partition wholly before the window attends nothing: max -1e30 and sum 0, which the reduce drops
        kv_start = tl.maximum(start, tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N)
    m_i, l_i, acc = attend_range(q, pos, m_i, l_i, acc, kv_start, end, end, k_cache_ptr, v_cache_ptr,
                                 block_table_row, dims, d_mask, kv_head, qk_scale, stride_c_block, stride_c_tok,
                                 stride_c_head, stride_v_block, stride_v_head, stride_v_dim, BLOCK_SIZE, BLOCK_N,
                                 False, True, V_TOKEN_MAJOR, PRECISION, blocks, first_block, True, window,
                                 softcap_log2, WINDOWED, SOFTCAPPED, FP8_PV)
    if LONE:  # the one partition holds the whole context: the output itself, no partials to combine
        out = acc * (out_scale / l_i)[:, None]
        if QUANT:  # quantize the group's rows alone: the tile's others pad it to tl.dot's 16
            group_rows = tl.arange(0, GROUP_ROWS)
            store_out(out_ptr + q_tok * stride_o_tok + (kv_head * GROUP + group_rows)[:, None] * stride_o_head
                      + dims[None, :], _leading_rows(out.to(q_ptr.dtype.element_ty), GROUP_ROWS),
                      (group_rows < GROUP)[:, None] & d_mask[None, :], quant_scale_ptr, q_ptr.dtype.element_ty,
                      QUANT)
        else:
            store_out(out_ptr + q_tok * stride_o_tok + head[:, None] * stride_o_head + dims[None, :], out,
                      row_mask[:, None] & d_mask[None, :], quant_scale_ptr, q_ptr.dtype.element_ty, QUANT)
        return
    acc = acc * out_scale

    part_idx = (seq.to(tl.int64) * num_heads + head) * max_partitions + part  # [BLOCK_G]
    tl.store(part_m_ptr + part_idx, m_i, mask=row_mask)
    tl.store(part_l_ptr + part_idx, l_i, mask=row_mask)
    tl.store(part_acc_ptr + part_idx[:, None] * HEAD_DIM + dims[None, :], acc,
             mask=row_mask[:, None] & d_mask[None, :])
    if COMBINE:  # the last of the (sequence, KV head)'s partitions to finish combines them: no reduce kernel
        tl.debug_barrier()  # every thread's partials stored before the count releases them (acq_rel, GPU scope)
        counter = counters_ptr + seq * tl.num_programs(0) + kv_head
        if tl.atomic_add(counter, 1) == tl.cdiv(seq_len, chunk) - 1:
            tl.store(counter, 0)  # for the next launch
            group_rows = tl.arange(0, GROUP_ROWS)
            group_mask = group_rows < GROUP
            first = (seq.to(tl.int64) * num_heads + kv_head * GROUP + group_rows) * max_partitions
            out = _combined_partitions(part_m_ptr, part_l_ptr, part_acc_ptr, first, group_mask,
                                       tl.cdiv(seq_len, chunk), dims, d_mask, HEAD_DIM, BLOCK_P)
            store_out(out_ptr + q_tok * stride_o_tok + (kv_head * GROUP + group_rows)[:, None] * stride_o_head
                      + dims[None, :], out, group_mask[:, None] & d_mask[None, :], quant_scale_ptr,
                      q_ptr.dtype.element_ty, QUANT)


@triton.jit
def _combined_partitions(part_m_ptr, part_l_ptr, part_acc_ptr, rows, row_mask, num_parts, dims, d_mask,
                         HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr):
    """The output of the heads whose partials start at ``rows`` [R] (``num_parts`` partitions each), [R, BLOCK_D]:
    the partitions' unnormalised outputs weighted by their maxima, over the weighted sums. The partials are read
    from L2 (``.cg``): other programs wrote them in this launch."""
    parts = tl.arange(0, BLOCK_P)
    mask = row_mask[:, None] & (parts < num_parts)[None, :]
    idx = rows[:, None] + parts[None, :]
    m = tl.load(part_m_ptr + idx, mask=mask, other=float("-inf"), cache_modifier=".cg")
    part_sum = tl.load(part_l_ptr + idx, mask=mask, other=0.0, cache_modifier=".cg")
    acc = tl.load(part_acc_ptr + idx[:, :, None] * HEAD_DIM + dims[None, None, :],
                  mask=mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
    weight = tl.exp2(m - tl.max(m, 1)[:, None])  # masked partitions: exp2(-inf) = 0
    return tl.sum(acc * weight[:, :, None], 1) / tl.sum(part_sum * weight, 1)[:, None]


@triton.jit(do_not_specialize=["max_partitions"])
def _decode_reduce_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, query_start_loc_ptr, seq_lens_ptr,
                          quant_scale_ptr, stride_o_tok, stride_o_head, num_heads, max_partitions,
                          HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                          PARTITION_SIZE: tl.constexpr, CHUNK_ALIGN: tl.constexpr, DTYPE: tl.constexpr,
                          QUANT: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, _chunk(seq_len, max_partitions, PARTITION_SIZE, CHUNK_ALIGN))
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    row = tl.full([1], 0, tl.int64) + (seq.to(tl.int64) * num_heads + head) * max_partitions  # this head's
    out = _combined_partitions(part_m_ptr, part_l_ptr, part_acc_ptr, row, tl.full([1], 1, tl.int1), num_parts, dims,
                               d_mask, HEAD_DIM, BLOCK_P)
    q_tok = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    store_out(out_ptr + q_tok * stride_o_tok + head * stride_o_head + dims[None, :], out, d_mask[None, :],
              quant_scale_ptr, DTYPE, QUANT)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, partition_size: int | None = None,
                           block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                           quant_scale: torch.Tensor | None = None, pdl: bool = True, window: int | None = None,
                           softcap: float | None = None, lone: bool = True, fp8_pv: bool = False) -> torch.Tensor:
    """Split-KV decode (one new token per sequence): q [num_tokens, num_heads, head_dim] -> same shape (dtype,
    ``window`` and ``softcap`` as for the varlen kernel), the rows of meta's sequences attended (every row unless
    meta holds a batch's leading decodes, ``leading_decodes``).

    ``out`` as for the varlen kernel. ``partition_size`` (default: ``decode_partition_size``) must be a power of
    two, at least 16 (``block_n`` and ``num_stages`` default to ``DECODE_TILES``; tiles of SHORT_CONTEXT_BLOCK_N
    where neither meta.max_seq_len nor ``partition_size`` exceeds SHORT_CONTEXT): the grid holds
    cdiv(meta.max_seq_len, partition_size) partitions a sequence, and each context is split into that many of equal
    length (whole tiles, at most ``partition_size``), so that contexts shorter than meta's bound (a decode graph's
    plan) still spread over the programs. The partial results live in float32 scratch of num_seqs * num_heads *
    cdiv(meta.max_seq_len, partition_size) * (head_dim + 2) elements. When every context fits one partition and
    ``lone``, the partition kernel writes the output itself: no partials, no reduce kernel. With ``fp8_pv`` (an FP8
    cache, V token-major, a 16-bit q) p @ v runs on E4M3 operands, the values as stored and the probabilities scaled
    by P_SCALE, as TensorRT-LLM's Hopper decode kernel (XQA) does over an FP8 cache.
    """
    fp8, v_token_major = check_operands(q, k_cache, v_cache, k_scale, v_scale)
    if fp8_pv and not fp8_pv_applies(q, k_cache, v_cache):
        raise ValueError(f"paged_attention: fp8_pv needs an FP8 cache with V token-major and a 16-bit q, got a "
                         f"{k_cache.dtype} cache{'' if v_token_major else ' with V contiguous'} and {q.dtype} q")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = meta.seq_lens.shape[0]
    partition_size = partition_size or decode_partition_size(num_seqs, num_kv_heads, meta.max_seq_len, q.device, fp8)
    max_partitions = triton.cdiv(meta.max_seq_len, partition_size)
    # a caller that fixes long partitions (a mixed step's decodes) launches for contexts that long: one tile for all
    block_n = min(block_n or decode_block_n(fp8, max(meta.max_seq_len, partition_size)), partition_size)
    align = min(partition_size, max(block_n, block_size))  # whole tiles, and whole blocks where a partition holds any
    num_stages = num_stages or DECODE_TILES[fp8]["num_stages"]
    block_d = max(triton.next_power_of_2(head_dim), 16)
    out = output_for(q, quant_scale) if out is None else out
    # One partition per sequence, on an H200 (FP8 KV, CUDA-graph medians a layer): writing the output from the
    # partition kernel instead of the reduce's is 13 % faster at 2,048 sequences of 129-256 tokens (355 -> 307 us)
    # and 3 % at 488 of 1,000-2,000 (386 -> 374), bit-identical; quantized for an FP8 o_proj, with only the GQA
    # group's rows quantized, 14 % (358 -> 308 us) and 4 % (414 -> 399), bit-identical too.
    lone = max_partitions == 1 and lone
    combine = not lone and combine_partitions(meta, num_seqs, num_kv_heads, max_partitions)
    part_m = part_l = part_acc = out  # not written when lone
    if not lone:
        part_m = torch.empty(num_seqs, num_heads, max_partitions, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_seqs, num_heads, max_partitions, head_dim, dtype=torch.float32, device=q.device)
    quant = q if quant_scale is None else quant_scale
    _decode_partition_kernel[(num_kv_heads, num_seqs, max_partitions)](
        q, k_cache, v_cache, part_m, part_l, part_acc, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        k_scale if fp8 else q, v_scale if fp8 else q, quant, meta.partition_counters if combine else meta.seq_lens,
        scale * LOG2E, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(2), v_cache.stride(3), meta.block_tables.stride(0), num_heads, max_partitions, window or 0,
        (softcap or 1.0) * LOG2E, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(triton.next_power_of_2(group), 16), BLOCK_N=block_n, BLOCK_D=block_d,
        PARTITION_SIZE=partition_size, FP8=fp8, FP16=fp16_compute(q, fp8), PRECISION=dot_precision(q),
        V_TOKEN_MAJOR=v_token_major, PARTITION_BLOCKS=max(partition_size // block_size, 2), CHUNK_ALIGN=align,
        LONE=lone, QUANT=quant_scale is not None, GROUP_ROWS=triton.next_power_of_2(group), num_warps=num_warps,
        num_stages=num_stages, WINDOWED=window is not None, SOFTCAPPED=softcap is not None, COMBINE=combine,
        BLOCK_P=max(triton.next_power_of_2(max_partitions), 2) if combine else 2,  # no variant when unused
        FP8_PV=fp8_pv, **pdl_options(q, pdl))
    if lone or combine:
        return out
    _decode_reduce_kernel[(num_seqs, num_heads)](
        out, part_m, part_l, part_acc, meta.query_start_loc, meta.seq_lens, quant, out.stride(0), out.stride(1),
        num_heads, max_partitions,
        HEAD_DIM=head_dim, BLOCK_P=max(triton.next_power_of_2(max_partitions), 2), BLOCK_D=block_d,
        PARTITION_SIZE=partition_size, CHUNK_ALIGN=align, DTYPE=TRITON_DTYPES[q.dtype], QUANT=quant_scale is not None,
        num_warps=4,
        **pdl_options(q, pdl))
    return out
