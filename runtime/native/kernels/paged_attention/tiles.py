"""The KV-tile loop both paged-attention kernels run: tokens found through the block table, K and V tiles loaded
(V contiguous, as a transposed tile, or token-major), online softmax in float32, and the output stored (quantized for
an FP8 linear when asked)."""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.runtime.native.kernels.rounding import quantize_e4m3, to_e4m3

# FP8 p @ v (decode over an FP8 cache, ``fp8_pv``): the probabilities enter it as E4M3 scaled by P_SCALE, so that
# those down to 2**-17 of the row's maximum keep a value (E4M3's smallest is 2**-9).
P_SCALE = tl.constexpr(256.0)


@triton.jit
def block_numbers(block_table_row, blocks, first_block, offs, mask, BLOCK_SIZE: tl.constexpr,
                  PRELOADED: tl.constexpr):
    """The cache blocks holding tokens ``offs``: from ``blocks`` (the table's entries from ``first_block`` on, loaded
    before the loop) when PRELOADED, else read from the block table."""
    if PRELOADED:
        idx = tl.minimum(tl.maximum(offs // BLOCK_SIZE - first_block, 0), blocks.shape[0] - 1)
        return tl.gather(blocks, idx, 0).to(tl.int64)
    return tl.load(block_table_row + offs // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)


@triton.jit
def token_offsets(block_table_row, offs_n, n_mask, kv_head, stride_c_block, stride_c_tok, stride_c_head,
                  BLOCK_SIZE: tl.constexpr, blocks=0, first_block=0, PRELOADED: tl.constexpr = False):
    """Where tokens ``offs_n`` of one sequence start for one KV head, found through its block table."""
    block = block_numbers(block_table_row, blocks, first_block, offs_n, n_mask, BLOCK_SIZE, PRELOADED)
    return block * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head


@triton.jit
def load_kv_tile(cache_ptr, offs, n_mask, dims, d_mask, DTYPE: tl.constexpr):
    """The tokens at ``offs`` as columns, [BLOCK_D, BLOCK_N] (the B operand of q @ k), unscaled, in DTYPE."""
    x = tl.load(cache_ptr + offs[None, :] + dims[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
    return x.to(DTYPE)


@triton.jit
def load_kv_rows(cache_ptr, offs, n_mask, dims, d_mask, DTYPE: tl.constexpr):
    """The tokens at ``offs`` as rows, [BLOCK_N, BLOCK_D] (the B operand of p @ v), unscaled, in DTYPE."""
    x = tl.load(cache_ptr + offs[:, None] + dims[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    return x.to(DTYPE)


@triton.jit
def load_v_token_major(v_cache_ptr, block_table_row, n0, end, dims, d_mask, kv_head, stride_v_block, stride_v_head,
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
    block = block_numbers(block_table_row, blocks, first_block, first, first < end, BLOCK_SIZE, PRELOADED)
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
def load_q(q_ptrs, mask, FP16: tl.constexpr):
    """The query rows in the compute dtype: float16 against an FP8 cache (clamped to its range), else as stored."""
    q = tl.load(q_ptrs, mask=mask, other=0.0)
    if FP16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def kv_scales(k_scale_ptr, v_scale_ptr, scale_log2, FP8: tl.constexpr):
    """The factor of the raw q.k products (softmax scale in log2 units, times k_scale) and of the output."""
    qk_scale = scale_log2
    out_scale = 1.0
    if FP8:
        qk_scale = scale_log2 * tl.load(k_scale_ptr)
        out_scale = tl.load(v_scale_ptr)
    return qk_scale, out_scale


@triton.jit
def store_out(out_ptrs, out, mask, quant_scale_ptr, DTYPE: tl.constexpr, QUANT: tl.constexpr):
    """Write output rows rounded to DTYPE (the model's), or, with QUANT, that value quantized for the next FP8
    linear with the scale at ``quant_scale_ptr``: the bytes ``runtime.native.kernels.fp8_quant`` would write from it."""
    out = out.to(DTYPE)
    if QUANT:
        out = quantize_e4m3(out, tl.load(quant_scale_ptr))
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def softmax_update(s, m_i, l_i):
    """The running max and sum after one tile of masked, log2-scaled scores ``s``; the rescale of the old output
    and the tile's unnormalised probabilities."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one tile of scores ``s`` and its values ``v`` [BLOCK_N, BLOCK_D] into the running max, sum and output."""
    m_i, l_i, alpha, p = softmax_update(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_i, l_i, acc


@triton.jit
def pv_operand(p, DTYPE: tl.constexpr):
    """The probabilities as p @ v takes them: in DTYPE, or for E4M3 values (FP8 p @ v) E4M3 times P_SCALE."""
    if tl.float8e4nv == DTYPE:
        return to_e4m3(p * P_SCALE)
    return p.to(DTYPE)


@triton.jit
def online_softmax_step_vt(s, vt, m_i, l_i, acc_t, PRECISION: tl.constexpr):
    """``online_softmax_step`` with the values as V^T [BLOCK_D, BLOCK_N] and the output transposed, [BLOCK_D, rows].
    With E4M3 values (FP8 p @ v) the probabilities enter the product as E4M3 too, times P_SCALE."""
    m_i, l_i, alpha, p = softmax_update(s, m_i, l_i)
    acc_t = acc_t * alpha[None, :] + tl.dot(vt, tl.trans(pv_operand(p, vt.dtype)), input_precision=PRECISION)
    return m_i, l_i, acc_t


@triton.jit
def tanh(x):
    """tanh without overflow: from exp(-2|x|), which lies in (0, 1]."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def attend_tile(q, pos, m_i, l_i, acc, n0, end, k_cache_ptr, v_cache_ptr, block_table_row, dims, d_mask, kv_head,
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
    offs = token_offsets(block_table_row, offs_n, n_mask, kv_head, stride_c_block, stride_c_tok, stride_c_head,
                         BLOCK_SIZE, blocks, first_block, PRELOADED)
    load_mask = n_mask if MASKED else tl.full([BLOCK_N], 1, tl.int1)
    k = load_kv_tile(k_cache_ptr, offs, load_mask, dims, d_mask, q.dtype)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    if SOFTCAPPED:
        s = softcap_log2 * tanh(s / softcap_log2)
    if MASKED:
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= pos[:, None])
        if WINDOWED:
            visible = visible & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    if V_TOKEN_MAJOR:
        vt = load_v_token_major(v_cache_ptr, block_table_row, n0, end, dims, d_mask, kv_head, stride_v_block,
                                stride_v_head, stride_v_dim, BLOCK_SIZE, BLOCK_N,
                                tl.float8e4nv if FP8_PV else q.dtype, blocks, first_block, PRELOADED, MASKED)
        m_i, l_i, acc = online_softmax_step_vt(s, vt, m_i, l_i, acc, PRECISION)
    else:
        if V_ROWS:
            v = load_kv_rows(v_cache_ptr, offs, load_mask, dims, d_mask, q.dtype)
        else:
            v = tl.trans(load_kv_tile(v_cache_ptr, offs, load_mask, dims, d_mask, q.dtype))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
    return m_i, l_i, acc


@triton.jit
def attend_range(q, pos, m_i, l_i, acc, start, end, all_visible_end, k_cache_ptr, v_cache_ptr, block_table_row,
                 dims, d_mask, kv_head, qk_scale, stride_c_block, stride_c_tok, stride_c_head, stride_v_block,
                 stride_v_head, stride_v_dim, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 V_ROWS: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr, PRECISION: tl.constexpr, blocks=0,
                 first_block=0, PRELOADED: tl.constexpr = False, window=0, softcap_log2=0.0,
                 WINDOWED: tl.constexpr = False, SOFTCAPPED: tl.constexpr = False, FP8_PV: tl.constexpr = False):
    """``attend_tile`` over KV tokens ``start .. end`` (``start`` a multiple of BLOCK_N); ``acc`` comes back
    [rows, BLOCK_D] either way. When CAUSAL, every row sees the tokens before ``all_visible_end`` (at least
    ``start``), and the whole tiles before it are attended without masks: the masks of the causal diagonal cost the
    varlen kernel 3-13 % on an H200. Decode attends every tile masked: its partial tile is its last, and a second
    loop made it 1-13 % slower. WINDOWED, every tile is masked (rows see different windows)."""
    unmasked_end = start
    if CAUSAL and not WINDOWED:
        unmasked_end = start + (tl.minimum(end, all_visible_end) - start) // BLOCK_N * BLOCK_N
        for n0 in range(start, unmasked_end, BLOCK_N):
            m_i, l_i, acc = attend_tile(q, pos, m_i, l_i, acc, n0, end, k_cache_ptr, v_cache_ptr, block_table_row,
                                        dims, d_mask, kv_head, qk_scale, stride_c_block, stride_c_tok, stride_c_head,
                                        stride_v_block, stride_v_head, stride_v_dim, BLOCK_SIZE, BLOCK_N, CAUSAL,
                                        V_ROWS, V_TOKEN_MAJOR, PRECISION, blocks, first_block, PRELOADED, False,
                                        window, softcap_log2, WINDOWED, SOFTCAPPED, FP8_PV)
    for n0 in range(unmasked_end, end, BLOCK_N):
        m_i, l_i, acc = attend_tile(q, pos, m_i, l_i, acc, n0, end, k_cache_ptr, v_cache_ptr, block_table_row, dims,
                                    d_mask, kv_head, qk_scale, stride_c_block, stride_c_tok, stride_c_head,
                                    stride_v_block, stride_v_head, stride_v_dim, BLOCK_SIZE, BLOCK_N, CAUSAL, V_ROWS,
                                    V_TOKEN_MAJOR, PRECISION, blocks, first_block, PRELOADED, True, window,
                                    softcap_log2, WINDOWED, SOFTCAPPED, FP8_PV)
    if V_TOKEN_MAJOR:
        acc = tl.trans(acc)
    return m_i, l_i, acc
