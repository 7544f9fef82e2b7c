"""Paged attention in Triton: the GPU twin of ``runtime.native.layers.attention.paged_attention_reference``.

Two kernels over the same paged caches ([num_blocks, block_size, num_kv_heads, head_dim]; K contiguous, V contiguous
or token-major within each block, as an engine keeps an FP8 V cache: ``runtime.native.kv_cache``). An FP8 cache is read
as it is stored: its elements convert exactly to float16 (one instruction per pair on sm_89+) and the two scales
are applied once per tile, ``k_scale`` to the scores and ``v_scale`` to the output, instead of per element. With
``fp8_pv``, decode keeps V in E4M3 and rounds the probabilities to E4M3 for p @ v.
V enters p @ v as rows [tokens, head_dim] (decode, contiguous V), as a transposed [head_dim, tokens] tile (varlen,
contiguous V), or, token-major, as V^T in v^T @ p^T with the output accumulated transposed.

- ``paged_attention_varlen``: any flat batch (prefill, chunked prefill, prefix-cache hits, decode). Token t of
  sequence i sits at position ``seq_lens[i] - q_len_i + t`` and attends causally. One program per (query tile of a
  sequence, KV head); its rows are the tile's tokens times the KV head's GQA group, so each K/V tile is read once for
  the whole group. Online softmax in float32, K/V gathered through the block table token by token.
- ``paged_attention_decode``: every q_len == 1 (flash-decoding). The context is cut into partitions of
  ``partition_size`` tokens (64 to 2048, smaller when few sequences would leave SMs idle); one program per
  (sequence, KV head, partition) reads the partition's block-table entries once, then writes a partial max, sum and
  unnormalised output, and a second kernel combines the partitions of each (sequence, head). When one partition
  holds every context, the partition kernel writes the output itself; in a small decode graph's step of two
  partitions, the last of them to finish combines both (``combine_partitions``).

Both grids launch the KV heads fastest, so that the programs reading one token's heads, whose K rows lie side by side
in the cache, run together (on an H200 decode is 1.2-2.5 % faster than with the sequences fastest, varlen 0.3-4 %).
Every length is read from device tensors: the grids are bounded by ``meta.max_query_len`` / ``meta.max_seq_len``,
host ints the metadata already carries, so no launch synchronises with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.kernels.device_limits import num_sms
from kiln.runtime.native.kernels.pdl import pdl_options, wait_for_previous_kernel
from kiln.runtime.native.kernels.rounding import TRITON_DTYPES, quantize_e4m3, to_e4m3
from kiln.runtime.native.kv_cache import is_token_major

LOG2E = 1.4426950408889634
# Split-KV decode partitions hold a power of two of 64..4096 tokens, chosen by counting waves: the grid (sequences x
# KV heads x partitions) runs ``programs_per_sm`` programs an SM at a time (the kernel's occupancy, DECODE_TILES),
# each wave as long as a partition plus PROGRAM_COST_TOKENS of fixed work, and more than one partition adds the reduce
# kernel, REDUCE_COST_TOKENS. Fitted to tools/tune_partitions.py on an H200 (FP8 KV, output quantized, 2026-12-04:
# batches 4-256, plans of 1-8k tokens, contexts filling all or a quarter of them): the chosen size is within 2 % of
# the fastest (geometric mean; 7 % at a quarter), where the rule before (about 4 programs per SM) was 12 % off (21 %).
# The bf16 kernel's smaller tiles fit 4 programs an SM: counted with 3, its sizes were one step too long below batch
# 64 (9 % off the fastest on average, 27 % at worst); with 4, 0.2 % (2 %), and 3.8 % (32 %) for contexts a quarter
# of the plan (batches 4-128 of the same grid, 2026-12-04).
# KV tokens per tile and pipeline stages by cache dtype (model dtype, FP8), the fastest of tools/tune_attention.py on
# an H200 at batch 256 over 1k-2k contexts, and for a 1k-token prefill (FP8: with V token-major; 128-token varlen
# tiles spill registers there). On the H200, decode reading a contiguous V as rows (which the compiler copies
# asynchronously) was 12-15 % faster than the transposed tile, which the varlen kernel keeps (13 % faster there for
# bf16); an FP8 V read token-major was another 22 % faster in decode, 15 % slower in varlen. Decode with FP8 KV
# prefetches one tile ahead (3 stages: 2 K/V buffers, 74 KB of shared memory, 3 programs per SM), 7-9 % faster than
# 2 stages at batch 256; a bf16 cache gains nothing from it.
DECODE_TILES = {False: dict(block_n=64, num_stages=2, programs_per_sm=4),
                True: dict(block_n=128, num_stages=3, programs_per_sm=3)}
VARLEN_TILES = {False: dict(block_n=64, num_stages=2), True: dict(block_n=64, num_stages=3)}
# Contexts of up to SHORT_CONTEXT tokens (TensorRT-LLM's 128/128 row) read in tiles of at most SHORT_CONTEXT_BLOCK_N:
# each program then holds two to four tiles, not one or two. FP8 KV on an H200, output quantized, a plan of 256 tokens,
# contexts of 129-256 (2026-12-04, CUDA-graph medians a layer): 2,048 sequences 323 -> 295 us, 512 85 -> 79, 64 14.8
# -> 11.8, 8 unchanged. Over 1-2k tokens the 64-token tile is 8 % slower, so longer plans keep DECODE_TILES, and so do
# mixed steps (their partitions of MAX_PARTITION_SIZE), which keeps them to one compiled kernel whatever their
# contexts (with short tiles, 2,048 decodes of 129-256 tokens there took 307 us instead of 329).
SHORT_CONTEXT, SHORT_CONTEXT_BLOCK_N = 256, 64
MIN_PARTITION_SIZE, MAX_PARTITION_SIZE = 64, 4096
PROGRAM_COST_TOKENS, REDUCE_COST_TOKENS = 512, 128
# Small decode steps of two partitions skip the reduce kernel: the last of a (sequence, KV head)'s partitions to
# finish combines them (``combine_partitions``). On an H200 (FP8, FP8 KV, contexts of 1k, graph replay, two rounds)
# a step of 16 sequences (two partitions of 512) took 3.61-3.62 ms against 3.72; where the partitions are many, one
# program combining them all lost to the reduce kernel's many as often as it won (8 partitions at 4 sequences:
# 3.17-3.18 against 3.07 ms; 16 at 2: 3.03-3.04 against 2.99-3.00; 16 at one: 2.656-2.663 against 2.671-2.678).
COMBINE_MAX_SEQS, COMBINE_MAX_PARTITIONS = 16, 2
# FP8 p @ v (decode over an FP8 cache, ``fp8_pv``): the probabilities enter it as E4M3 scaled by P_SCALE, so that
# those down to 2**-17 of the row's maximum keep a value (E4M3's smallest is 2**-9).
P_SCALE = tl.constexpr(256.0)


@triton.jit
def _block_numbers(block_table_row, blocks, first_block, offs, mask, BLOCK_SIZE: tl.constexpr,
                   PRELOADED: tl.constexpr):
    """The cache blocks holding tokens ``offs``: from ``blocks`` (the table's entries from ``first_block`` on, loaded
    before the loop) when PRELOADED, else read from the block table."""
    if PRELOADED:
        idx = tl.minimum(tl.maximum(offs // BLOCK_SIZE - first_block, 0), blocks.shape[0] - 1)
        return tl.gather(blocks, idx, 0).to(tl.int64)
    return tl.load(block_table_row + offs // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)


@triton.jit
def _token_offsets(block_table_row, offs_n, n_mask, kv_head, stride_c_block, stride_c_tok, stride_c_head,
                   BLOCK_SIZE: tl.constexpr, blocks=0, first_block=0, PRELOADED: tl.constexpr = False):
    """Where tokens ``offs_n`` of one sequence start for one KV head, found through its block table."""
    block = _block_numbers(block_table_row, blocks, first_block, offs_n, n_mask, BLOCK_SIZE, PRELOADED)
    return block * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head


@triton.jit
def _load_kv_tile(cache_ptr, offs, n_mask, dims, d_mask, DTYPE: tl.constexpr):
    """The tokens at ``offs`` as columns, [BLOCK_D, BLOCK_N] (the B operand of q @ k), unscaled, in DTYPE."""
    x = tl.load(cache_ptr + offs[None, :] + dims[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
    return x.to(DTYPE)


@triton.jit
def _load_kv_rows(cache_ptr, offs, n_mask, dims, d_mask, DTYPE: tl.constexpr):
    """The tokens at ``offs`` as rows, [BLOCK_N, BLOCK_D] (the B operand of p @ v), unscaled, in DTYPE."""
    x = tl.load(cache_ptr + offs[:, None] + dims[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    return x.to(DTYPE)


@triton.jit
def _load_v_token_major(v_cache_ptr, block_table_row, n0, end, dims, d_mask, kv_head, stride_v_block, stride_v_head,
                        stride_v_dim, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
                        blocks=0, first_block=0, PRELOADED: tl.constexpr = False, MASKED: tl.constexpr = True):
    """Tokens ``n0 .. n0 + BLOCK_N`` of a token-major V cache as V^T, [BLOCK_D, BLOCK_N] (the A operand of
    v^T @ p^T), unscaled, in DTYPE. ``n0`` is a multiple of BLOCK_N. The tile is loaded as runs of tokens contiguous
    within a block, [BLOCK_D, runs, run], so the compiler copies it asynchronously, 16 bytes at a time; runs from
    ``end`` on read zeros (unless not MASKED: the tile ends before ``end``), but the last block's tokens past ``end``
    are read as they are: bytes a previous sequence left, which the FP8 KV store keeps finite (never NaN), so their
    zero probabilities cancel them."""
    RUN: tl.constexpr = BLOCK_SIZE if BLOCK_SIZE < BLOCK_N else BLOCK_N
    first = n0 + tl.arange(0, BLOCK_N // RUN) * RUN  # each run's first token
    block = _block_numbers(block_table_row, blocks, first_block, first, first < end, BLOCK_SIZE, PRELOADED)
    base = block * stride_v_block + kv_head * stride_v_head
    if BLOCK_SIZE > BLOCK_N:
        base += tl.multiple_of(first % BLOCK_SIZE, BLOCK_N)
    tok = tl.arange(0, RUN)
    mask = d_mask[:, None, None]
    if MASKED:
        mask = mask & (first < end)[None, :, None]
    vt = tl.load(v_cache_ptr + base[None, :, None] + dims[:, None, None] * stride_v_dim + tok[None, None, :],
                 mask=mask, other=0.0)
    return tl.reshape(vt, [dims.shape[0], BLOCK_N]).to(DTYPE)


@triton.jit
def _load_q(q_ptrs, mask, FP16: tl.constexpr):
    """The query rows in the compute dtype: float16 against an FP8 cache (clamped to its range), else as stored."""
    q = tl.load(q_ptrs, mask=mask, other=0.0)
    if FP16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def _kv_scales(k_scale_ptr, v_scale_ptr, scale_log2, FP8: tl.constexpr):
    """The factor of the raw q.k products (softmax scale in log2 units, times k_scale) and of the output."""
    qk_scale = scale_log2
    out_scale = 1.0
    if FP8:
        qk_scale = scale_log2 * tl.load(k_scale_ptr)
        out_scale = tl.load(v_scale_ptr)
    return qk_scale, out_scale


@triton.jit
def _store_out(out_ptrs, out, mask, quant_scale_ptr, DTYPE: tl.constexpr, QUANT: tl.constexpr):
    """Write output rows rounded to DTYPE (the model's), or, with QUANT, that value quantized for the next FP8
    linear with the scale at ``quant_scale_ptr``: the bytes ``runtime.native.kernels.fp8_quant`` would write from it."""
    out = out.to(DTYPE)
    if QUANT:
        out = quantize_e4m3(out, tl.load(quant_scale_ptr))
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=mask)


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


@triton.jit
def _softmax_update(s, m_i, l_i):
    """The running max and sum after one tile of masked, log2-scaled scores ``s``; the rescale of the old output
    and the tile's unnormalised probabilities."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one tile of scores ``s`` and its values ``v`` [BLOCK_N, BLOCK_D] into the running max, sum and output."""
    m_i, l_i, alpha, p = _softmax_update(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_i, l_i, acc


@triton.jit
def _pv_operand(p, DTYPE: tl.constexpr):
    """The probabilities as p @ v takes them: in DTYPE, or for E4M3 values (FP8 p @ v) E4M3 times P_SCALE."""
    if tl.float8e4nv == DTYPE:
        return to_e4m3(p * P_SCALE)
    return p.to(DTYPE)


@triton.jit
def _online_softmax_step_vt(s, vt, m_i, l_i, acc_t, PRECISION: tl.constexpr):
    """``_online_softmax_step`` with the values as V^T [BLOCK_D, BLOCK_N] and the output transposed, [BLOCK_D, rows].
    With E4M3 values (FP8 p @ v) the probabilities enter the product as E4M3 too, times P_SCALE."""
    m_i, l_i, alpha, p = _softmax_update(s, m_i, l_i)
    acc_t = acc_t * alpha[None, :] + tl.dot(vt, tl.trans(_pv_operand(p, vt.dtype)), input_precision=PRECISION)
    return m_i, l_i, acc_t


@triton.jit
def _tanh(x):
    """tanh without overflow: from exp(-2|x|), which lies in (0, 1]."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _attend_tile(q, pos, m_i, l_i, acc, n0, end, k_cache_ptr, v_cache_ptr, block_table_row, dims, d_mask, kv_head,
                 qk_scale, stride_c_block, stride_c_tok, stride_c_head, stride_v_block, stride_v_head, stride_v_dim,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, V_ROWS: tl.constexpr,
                 V_TOKEN_MAJOR: tl.constexpr, PRECISION: tl.constexpr, blocks=0, first_block=0,
                 PRELOADED: tl.constexpr = False, MASKED: tl.constexpr = True, window=0, softcap_log2=0.0,
                 WINDOWED: tl.constexpr = False, SOFTCAPPED: tl.constexpr = False, FP8_PV: tl.constexpr = False):
    """Fold KV tokens ``n0 .. n0 + BLOCK_N`` (those before ``end``) into the running max, sum and output of the query
    rows ``q``, causally against the rows' positions ``pos`` when CAUSAL, and within the last ``window`` positions of
    each row when WINDOWED. ``acc`` is [rows, BLOCK_D], transposed for a token-major V cache; else V is loaded as rows
    when V_ROWS, as a transposed tile otherwise. Not MASKED, the tile must lie before ``end`` and be visible to every
    row: it is read and attended without masks. SOFTCAPPED, scores become ``cap * tanh(score / cap)`` (Gemma 2),
    ``softcap_log2`` being ``cap`` in the log2 units of ``qk_scale``. FP8_PV, a token-major V stays E4M3 (as stored)
    and p @ v runs on E4M3 operands."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    offs = _token_offsets(block_table_row, offs_n, n_mask, kv_head, stride_c_block, stride_c_tok, stride_c_head,
                          BLOCK_SIZE, blocks, first_block, PRELOADED)
    load_mask = n_mask if MASKED else tl.full([BLOCK_N], 1, tl.int1)
    k = _load_kv_tile(k_cache_ptr, offs, load_mask, dims, d_mask, q.dtype)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    if SOFTCAPPED:
        s = softcap_log2 * _tanh(s / softcap_log2)
    if MASKED:
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= pos[:, None])
        if WINDOWED:
            visible = visible & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    if V_TOKEN_MAJOR:
        vt = _load_v_token_major(v_cache_ptr, block_table_row, n0, end, dims, d_mask, kv_head, stride_v_block,
                                 stride_v_head, stride_v_dim, BLOCK_SIZE, BLOCK_N,
                                 tl.float8e4nv if FP8_PV else q.dtype, blocks, first_block, PRELOADED, MASKED)
        m_i, l_i, acc = _online_softmax_step_vt(s, vt, m_i, l_i, acc, PRECISION)
    else:
        if V_ROWS:
            v = _load_kv_rows(v_cache_ptr, offs, load_mask, dims, d_mask, q.dtype)
        else:
            v = tl.trans(_load_kv_tile(v_cache_ptr, offs, load_mask, dims, d_mask, q.dtype))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attend_range(q, pos, m_i, l_i, acc, start, end, all_visible_end, k_cache_ptr, v_cache_ptr, block_table_row,
                  dims, d_mask, kv_head, qk_scale, stride_c_block, stride_c_tok, stride_c_head, stride_v_block,
                  stride_v_head, stride_v_dim, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  V_ROWS: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr, PRECISION: tl.constexpr, blocks=0,
                  first_block=0, PRELOADED: tl.constexpr = False, window=0, softcap_log2=0.0,
                  WINDOWED: tl.constexpr = False, SOFTCAPPED: tl.constexpr = False, FP8_PV: tl.constexpr = False):
    """``_attend_tile`` over KV tokens ``start .. end`` (``start`` a multiple of BLOCK_N); ``acc`` comes back
    [rows, BLOCK_D] either way. When CAUSAL, every row sees the tokens before ``all_visible_end`` (at least
    ``start``), and the whole tiles before it are attended without masks: the masks of the causal diagonal cost the
    varlen kernel 3-13 % on an H200. Decode attends every tile masked: its partial tile is its last, and a second
    loop made it 1-13 % slower. WINDOWED, every tile is masked (rows see different windows)."""
    unmasked_end = start
    if CAUSAL and not WINDOWED:
        unmasked_end = start + (tl.minimum(end, all_visible_end) - start) // BLOCK_N * BLOCK_N
        for n0 in range(start, unmasked_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, pos, m_i, l_i, acc, n0, end, k_cache_ptr, v_cache_ptr, block_table_row,
                                         dims, d_mask, kv_head, qk_scale, stride_c_block, stride_c_tok, stride_c_head,
                                         stride_v_block, stride_v_head, stride_v_dim, BLOCK_SIZE, BLOCK_N, CAUSAL,
                                         V_ROWS, V_TOKEN_MAJOR, PRECISION, blocks, first_block, PRELOADED, False,
                                         window, softcap_log2, WINDOWED, SOFTCAPPED, FP8_PV)
    for n0 in range(unmasked_end, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, pos, m_i, l_i, acc, n0, end, k_cache_ptr, v_cache_ptr, block_table_row, dims,
                                     d_mask, kv_head, qk_scale, stride_c_block, stride_c_tok, stride_c_head,
                                     stride_v_block, stride_v_head, stride_v_dim, BLOCK_SIZE, BLOCK_N, CAUSAL, V_ROWS,
                                     V_TOKEN_MAJOR, PRECISION, blocks, first_block, PRELOADED, True, window,
                                     softcap_log2, WINDOWED, SOFTCAPPED, FP8_PV)
    if V_TOKEN_MAJOR:
        acc = tl.trans(acc)
    return m_i, l_i, acc


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
    q = _load_q(q_ptr + q_tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                row_mask[:, None] & d_mask[None, :], FP16)
    qk_scale, out_scale = _kv_scales(k_scale_ptr, v_scale_ptr, scale_log2, FP8)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite, so a fully masked row never makes NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_M] if V_TOKEN_MAJOR else [BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, context + tl.minimum(q_len, (q_tile + 1) * TOKENS))  # causal: last row's position
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    all_visible_end = context + q_tile * TOKENS + 1  # the tile's first row sees the tokens up to its own
    kv_start = 0
    if WINDOWED:  # the tile's first row sees nothing before its window
        kv_start = tl.maximum(context + q_tile * TOKENS - window + 1, 0) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = _attend_range(q, pos, m_i, l_i, acc, kv_start, kv_end, all_visible_end, k_cache_ptr, v_cache_ptr,
                                  block_table_row, dims, d_mask, kv_head, qk_scale, stride_c_block, stride_c_tok,
                                  stride_c_head, stride_v_block, stride_v_head, stride_v_dim, BLOCK_SIZE, BLOCK_N,
                                  True, False, V_TOKEN_MAJOR, PRECISION, window=window, softcap_log2=softcap_log2,
                                  WINDOWED=WINDOWED, SOFTCAPPED=SOFTCAPPED)

    out = acc * (out_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    _store_out(out_ptr + q_tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :], out,
               row_mask[:, None] & d_mask[None, :], quant_scale_ptr, q_ptr.dtype.element_ty, QUANT)


@triton.jit
def _chunk(seq_len, num_splits, PARTITION_SIZE: tl.constexpr, CHUNK_ALIGN: tl.constexpr):
    """Tokens per partition of a context of ``seq_len``: split into ``num_splits`` (the grid's) partitions of a
    multiple of CHUNK_ALIGN, at most PARTITION_SIZE, so that a short context in a grid sized for long ones is
    still spread over the programs."""
    return tl.minimum(tl.cdiv(tl.cdiv(seq_len, num_splits), CHUNK_ALIGN) * CHUNK_ALIGN, PARTITION_SIZE)


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
    q = _load_q(q_ptr + q_tok * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                row_mask[:, None] & d_mask[None, :], FP16)
    qk_scale, out_scale = _kv_scales(k_scale_ptr, v_scale_ptr, scale_log2, FP8)
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
    m_i, l_i, acc = _attend_range(q, pos, m_i, l_i, acc, kv_start, end, end, k_cache_ptr, v_cache_ptr,
                                  block_table_row, dims, d_mask, kv_head, qk_scale, stride_c_block, stride_c_tok,
                                  stride_c_head, stride_v_block, stride_v_head, stride_v_dim, BLOCK_SIZE, BLOCK_N,
                                  False, True, V_TOKEN_MAJOR, PRECISION, blocks, first_block, True, window,
                                  softcap_log2, WINDOWED, SOFTCAPPED, FP8_PV)
    if LONE:  # the one partition holds the whole context: the output itself, no partials to combine
        out = acc * (out_scale / l_i)[:, None]
        if QUANT:  # quantize the group's rows alone: the tile's others pad it to tl.dot's 16
            group_rows = tl.arange(0, GROUP_ROWS)
            _store_out(out_ptr + q_tok * stride_o_tok + (kv_head * GROUP + group_rows)[:, None] * stride_o_head
                       + dims[None, :], _leading_rows(out.to(q_ptr.dtype.element_ty), GROUP_ROWS),
                       (group_rows < GROUP)[:, None] & d_mask[None, :], quant_scale_ptr, q_ptr.dtype.element_ty,
                       QUANT)
        else:
            _store_out(out_ptr + q_tok * stride_o_tok + head[:, None] * stride_o_head + dims[None, :], out,
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
            _store_out(out_ptr + q_tok * stride_o_tok + (kv_head * GROUP + group_rows)[:, None] * stride_o_head
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
    _store_out(out_ptr + q_tok * stride_o_tok + head * stride_o_head + dims[None, :], out, d_mask[None, :],
               quant_scale_ptr, DTYPE, QUANT)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
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


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # no TF32 rounding for a float32 model


def fp8_pv_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether decode can multiply p @ v in FP8 here: an FP8 cache with V token-major, and a 16-bit q."""
    return k_cache.dtype == torch.float8_e4m3fn and is_token_major(v_cache) and q.dtype != torch.float32


def _fp16_compute(q: torch.Tensor, fp8: bool) -> bool:
    """Whether a 16-bit model attends an FP8 cache in float16: E4M3 converts to it exactly and natively, and the
    probabilities keep three more bits than in bfloat16."""
    return fp8 and q.dtype != torch.float32


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
    fp8, v_token_major = _check(q, k_cache, v_cache, k_scale, v_scale)
    block_n = block_n or VARLEN_TILES[fp8]["block_n"]
    num_stages = num_stages or VARLEN_TILES[fp8]["num_stages"]
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_m = max(block_m, triton.next_power_of_2(group), 16)
    out = _output(q, quant_scale) if out is None else out
    num_seqs = meta.seq_lens.shape[0] - first_seq
    grid = (num_kv_heads, triton.cdiv(meta.max_query_len, block_m // group), num_seqs)
    _varlen_kernel[grid](
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        k_scale if fp8 else q, v_scale if fp8 else q, q if quant_scale is None else quant_scale, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(2), v_cache.stride(3), meta.block_tables.stride(0),
        first_seq, window or 0, (softcap or 1.0) * LOG2E, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=max(block_n, 16),
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16), FP8=fp8, FP16=_fp16_compute(q, fp8),
        PRECISION=_precision(q), V_TOKEN_MAJOR=v_token_major, QUANT=quant_scale is not None, num_warps=num_warps,
        num_stages=num_stages, WINDOWED=window is not None, SOFTCAPPED=softcap is not None, **pdl_options(q, pdl))
    return out


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
    fp8, v_token_major = _check(q, k_cache, v_cache, k_scale, v_scale)
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
    block_n = min(block_n or _decode_block_n(fp8, max(meta.max_seq_len, partition_size)), partition_size)
    align = min(partition_size, max(block_n, block_size))  # whole tiles, and whole blocks where a partition holds any
    num_stages = num_stages or DECODE_TILES[fp8]["num_stages"]
    block_d = max(triton.next_power_of_2(head_dim), 16)
    out = _output(q, quant_scale) if out is None else out
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
        PARTITION_SIZE=partition_size, FP8=fp8, FP16=_fp16_compute(q, fp8), PRECISION=_precision(q),
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


def combine_partitions(meta: AttentionMetadata, num_seqs: int, num_kv_heads: int, max_partitions: int) -> bool:
    """Whether the last partition of each (sequence, KV head) to finish combines the partitions itself, instead of
    the reduce kernel: where meta carries ``partition_counters`` (a decode graph's: zeros, one a sequence and KV head,
    which each combining program leaves zero again) and the step is small (up to COMBINE_MAX_SEQS sequences and
    COMBINE_MAX_PARTITIONS partitions)."""
    counters = meta.partition_counters
    if counters is None or num_seqs > COMBINE_MAX_SEQS or max_partitions > COMBINE_MAX_PARTITIONS:
        return False
    if counters.dtype != torch.int32 or counters.numel() < num_seqs * num_kv_heads:
        raise ValueError(f"paged_attention: partition_counters must be int32 with {num_seqs * num_kv_heads} "
                         f"entries or more, got {counters.dtype} {list(counters.shape)}")
    return True


def _decode_block_n(fp8: bool, max_seq_len: int) -> int:
    """KV tokens per tile of the split-KV decode over contexts of up to ``max_seq_len``."""
    block_n = DECODE_TILES[fp8]["block_n"]
    return min(block_n, SHORT_CONTEXT_BLOCK_N) if max_seq_len <= SHORT_CONTEXT else block_n


def _output(q: torch.Tensor, quant_scale: torch.Tensor | None) -> torch.Tensor:
    """The attention output: q's shape, in q's dtype or, quantized for an FP8 linear, float8_e4m3fn."""
    return torch.empty(q.shape, dtype=q.dtype if quant_scale is None else torch.float8_e4m3fn, device=q.device)


def decode_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                          fp8: bool) -> int:
    """Tokens per split-KV partition over contexts of up to ``max_seq_len`` in an FP8 (``fp8``) or model-dtype
    cache: the power of two from MIN_PARTITION_SIZE to MAX_PARTITION_SIZE (and no larger than one partition holding
    ``max_seq_len`` needs) whose waves of programs take the least time by the count above; the smaller size on a
    tie."""
    slots = DECODE_TILES[fp8]["programs_per_sm"] * num_sms(device)

    def cost(size: int) -> int:
        partitions = triton.cdiv(max_seq_len, size)
        waves = triton.cdiv(num_seqs * num_kv_heads * partitions, slots)
        return waves * (min(size, max_seq_len) + PROGRAM_COST_TOKENS) + (REDUCE_COST_TOKENS if partitions > 1 else 0)

    sizes = [MIN_PARTITION_SIZE]
    while sizes[-1] < min(max_seq_len, MAX_PARTITION_SIZE):
        sizes.append(sizes[-1] * 2)
    return min(sizes, key=cost)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    quant_scale: torch.Tensor | None = None, pdl: bool = True, window: int | None = None,
                    softcap: float | None = None, fp8_pv: bool = False) -> torch.Tensor:
    """Same contract as ``paged_attention_reference`` (with ``quant_scale`` the output quantized for an FP8 linear,
    as the varlen kernel does): split-KV decode when every q_len is 1, varlen otherwise; a
    mixed step's leading decodes go through the decode kernel (on an H200, varlen reads their long contexts in one
    program per sequence and KV head: 63 of a 168 ms step of 504 decodes and 7,688 prefill tokens, 32 once split).
    Their partitions are the largest, whatever the step's size, so that every mixed step runs one compiled kernel
    (one partition holds each context of up to MAX_PARTITION_SIZE tokens, with no reduce). ``fp8_pv``: the decodes'
    p @ v in FP8 where the cache allows it (``paged_attention_decode``); prompts keep float16."""
    options = dict(quant_scale=quant_scale, pdl=pdl, window=window, softcap=softcap)
    fp8_pv = fp8_pv and fp8_pv_applies(q, k_cache, v_cache)
    if meta.max_query_len == 1:
        return paged_attention_decode(q, k_cache, v_cache, meta, scale, k_scale, v_scale, fp8_pv=fp8_pv, **options)
    if meta.num_decode_seqs:
        out = paged_attention_decode(q, k_cache, v_cache, meta.leading_decodes(), scale, k_scale, v_scale,
                                     partition_size=MAX_PARTITION_SIZE, fp8_pv=fp8_pv, **options)
        return paged_attention_varlen(q, k_cache, v_cache, meta, scale, k_scale, v_scale, out=out,
                                      first_seq=meta.num_decode_seqs, **options)
    return paged_attention_varlen(q, k_cache, v_cache, meta, scale, k_scale, v_scale, **options)
