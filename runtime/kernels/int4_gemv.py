"""Weight-streaming INT4-AWQ (W4A16) linear for small batches: ``y = (x * pre_quant_scale) @ (q * scales)^T``.

The layout is ``runtime.layers.linear``'s: ``qweight`` uint8 [N, K // 2], byte j of row n holds input columns 2j
(low nibble) and 2j + 1 (high nibble) as ``q + 8``; ``scales`` float32 [N, K // group_size]; ``pre_quant_scale``
float32 [K]. At M = 1 the activation is multiplied by ``pre_quant_scale`` as it is loaded, the product rounded to
the activation dtype (the bytes of the reference's multiply, without a kernel of its own); larger M multiply it once
first, since every program of the ``tl.dot`` kernel redoing it on each tile made batch-8 decode 29 % slower on an
H200. Each program owns ``BLOCK_N`` output rows and walks K in ``BLOCK_K`` chunks (a multiple of the group size):
it loads the packed bytes and the chunk's group scales once and splits the nibbles in registers. M = 1 reads the
bytes as int32 words and sums ``q * x`` per group, multiplying each group's sum by its scale once (at three
instructions a weight, ``_int4_awq_gemv_row_kernel``); larger M dequantizes the tile, rounds it to the activation
dtype (as ``int4_awq_linear_reference`` does) and runs ``tl.dot`` against the even and odd activation columns. A
nibble becomes a float by bit arithmetic rather than an integer-to-float conversion, which runs at a quarter of the
FMA rate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.pdl import pdl_options, wait_for_previous_kernel


@triton.jit
def nibble_value(nibble):
    """``nibble - 8`` as float32 for int32 ``nibble`` in 0..15: 0x4B000000 | n is the float 2**23 + n, exactly."""
    return (nibble | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _scaled_activation(x_ptrs, pqs_ptrs, mask):
    """x * pre_quant_scale rounded to x's dtype, as float32: what ``x * pre_quant_scale.to(x.dtype)`` gives."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    pqs = tl.load(pqs_ptrs, mask=mask, other=0.0).to(x.dtype)
    return (x.to(tl.float32) * pqs.to(tl.float32)).to(x.dtype).to(tl.float32)


@triton.jit
def _one_plus_sixteenth(w, one, SHIFT: tl.constexpr):
    """``1 + n / 16`` as float32 for the nibble n at bits SHIFT..SHIFT+3 of int32 ``w``: n shifted into the top
    mantissa bits of 1.0 (``one``: 0x3F800000, an argument, since as an immediate it would cost a second LOP3)."""
    t = w << (19 - SHIFT) if SHIFT <= 19 else w >> (SHIFT - 19)
    return ((t & 0x00780000) | one).to(tl.float32, bitcast=True)


@triton.jit
def _columns_of_words(x, WORDS: tl.constexpr):
    """x [WORDS * 8] as eight [WORDS] tensors: column 8w + i of each word w, for i = 0..7."""
    a, b = tl.split(tl.reshape(x, [WORDS, 4, 2]))  # i = 0, 2, 4, 6 and 1, 3, 5, 7
    a0, a1 = tl.split(tl.reshape(a, [WORDS, 2, 2]))  # 0, 4 and 2, 6
    b0, b1 = tl.split(tl.reshape(b, [WORDS, 2, 2]))  # 1, 5 and 3, 7
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _int4_awq_gemv_row_kernel(x_ptr, qw_ptr, scales_ptr, pqs_ptr, y_ptr, N, K: tl.constexpr, stride_qn, stride_sn, one,
                              GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr):
    """M = 1 over the packed weight read as int32 words (8 nibbles: columns 8w .. 8w + 7, low nibble first): each
    step covers GROUPS whole groups of BLOCK_N rows. Each nibble n becomes ``f = 1 + n / 16`` with one shift and one
    LOP3, and ``sum_k (n_k - 8) x_k = 16 sum_k f_k x_k - 24 sum_k x_k`` per group, so a weight costs a shift, a LOP3
    and an FFMA (the byte-wise form took 1.5x the instructions per byte, compiled for sm_90)."""
    wait_for_previous_kernel(PDL)
    WORDS: tl.constexpr = GROUPS * GROUP_SIZE // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, WORDS)
    offs_g = tl.arange(0, GROUPS)
    cols = tl.arange(0, WORDS * 8)  # the step's input columns
    qw_rows = qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, WORDS * 8):
        words = k0 // 8 + offs_w
        w = tl.load(qw_rows + words[None, :], mask=mask_n[:, None] & (words < K // 8)[None, :], other=0)
        x = _scaled_activation(x_ptr + k0 + cols, pqs_ptr + k0 + cols, cols < K - k0)
        x0, x1, x2, x3, x4, x5, x6, x7 = _columns_of_words(x, WORDS)
        s = _one_plus_sixteenth(w, one, 0) * x0[None, :]
        s += _one_plus_sixteenth(w, one, 4) * x1[None, :]
        s += _one_plus_sixteenth(w, one, 8) * x2[None, :]
        s += _one_plus_sixteenth(w, one, 12) * x3[None, :]
        s += _one_plus_sixteenth(w, one, 16) * x4[None, :]
        s += _one_plus_sixteenth(w, one, 20) * x5[None, :]
        s += _one_plus_sixteenth(w, one, 24) * x6[None, :]
        s += _one_plus_sixteenth(w, one, 28) * x7[None, :]
        f_x = tl.sum(tl.reshape(s, [BLOCK_N, GROUPS, GROUP_SIZE // 8]), axis=2)  # [BLOCK_N, GROUPS]
        x_sum = tl.sum(tl.reshape(x, [GROUPS, GROUP_SIZE]), axis=1)
        groups = k0 // GROUP_SIZE + offs_g
        scale = tl.load(scales_ptr + offs_n[:, None] * stride_sn + groups[None, :],
                        mask=mask_n[:, None] & (groups < K // GROUP_SIZE)[None, :], other=0.0)
        acc += tl.sum(scale * (16.0 * f_x - 24.0 * x_sum[None, :]), axis=1)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _int4_awq_gemv_kernel(x_ptr, qw_ptr, scales_ptr, y_ptr, M, N, K: tl.constexpr,
                          stride_xm, stride_qn, stride_sn, stride_ym,
                          GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    HALF_K: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // GROUP_SIZE
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, HALF_K)  # byte j of the chunk: input columns 2j and 2j + 1
    offs_g = tl.arange(0, GROUPS)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # input column of the chunk
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # masks and offsets over contiguous ranges (bytes, input columns), so that the loads are vectorised
        mask_j = k0 // 2 + offs_j < K // 2
        packed = tl.load(qw_ptr + offs_n[:, None].to(tl.int64) * stride_qn + (k0 // 2 + offs_j)[None, :],
                         mask=mask_n[:, None] & mask_j[None, :], other=0x88)
        q_even = nibble_value((packed & 0x0F).to(tl.int32))
        q_odd = nibble_value((packed >> 4).to(tl.int32))
        groups = k0 // GROUP_SIZE + offs_g
        scale = tl.load(scales_ptr + offs_n[:, None] * stride_sn + groups[None, :],
                        mask=mask_n[:, None] & (groups < K // GROUP_SIZE)[None, :], other=0.0)  # [BLOCK_N, GROUPS]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=mask_m[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, HALF_K, 2]))  # input columns 2j and 2j + 1
        s = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, GROUPS, GROUP_SIZE // 2]), [BLOCK_N, HALF_K])
        w_even = q_even * s
        w_odd = q_odd * s
        if tl.float32 == DOT_DTYPE:
            acc = tl.dot(x_even.to(tl.float32), tl.trans(w_even), acc, input_precision="ieee")
            acc = tl.dot(x_odd.to(tl.float32), tl.trans(w_odd), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_even.to(DOT_DTYPE), tl.trans(w_even.to(DOT_DTYPE)), acc)
            acc = tl.dot(x_odd.to(DOT_DTYPE), tl.trans(w_odd.to(DOT_DTYPE)), acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


ONE_BITS = 0x3F800000  # the float 1.0


def int4_gemv_config(m: int, n: int, k: int, group_size: int) -> dict:
    """Launch parameters: for M = 1 the fastest of a sweep on an H200 inside CUDA graphs over Llama-3-8B's shapes
    (tools/tune_gemv.py): 16 rows by 2048 input columns (4096 where the grid is small or the rows long) per step,
    so that a program has 16 KB or more of weight in flight; a 16-row ``tl.dot`` tile above."""
    if m == 1:
        small_grid, long_rows = n <= 4096, k > 4096
        columns = 4096 if small_grid or long_rows else 2048
        return dict(BLOCK_N=16, GROUPS=max(1, columns // group_size), num_warps=8 if n <= 8192 and not long_rows else 4,
                    num_stages=1)
    return dict(BLOCK_M=16, BLOCK_N=64 if n >= 16384 else 32, BLOCK_K=group_size * max(1, 256 // group_size),
                num_warps=4, num_stages=3)


def int4_awq_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pre_quant_scale: torch.Tensor,
                  group_size: int = 128, config: dict | None = None) -> torch.Tensor:
    """INT4-AWQ linear for small M: x [..., K] (float32/float16/bfloat16), qweight uint8 [N, K // 2],
    scales float32 [N, K // group_size], pre_quant_scale float32 [K]. Returns [..., N] in ``x.dtype``."""
    n, half_k = qweight.shape
    k = 2 * half_k
    if qweight.dtype != torch.uint8 or x.shape[-1] != k or k % group_size or group_size % 2:
        raise ValueError(f"int4_awq_gemv: qweight must be uint8 [N, {x.shape[-1] // 2}] with K a multiple of an even "
                         f"group_size {group_size}, got {qweight.dtype} {list(qweight.shape)}")
    if scales.shape != (n, k // group_size) or pre_quant_scale.shape != (k,):
        raise ValueError(f"int4_awq_gemv: scales must be [{n}, {k // group_size}] and pre_quant_scale [{k}], "
                         f"got {list(scales.shape)} and {list(pre_quant_scale.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scales = scales if scales.stride(-1) == 1 else scales.contiguous()
    pre_quant_scale = pre_quant_scale.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = dict(config or int4_gemv_config(m, n, k, group_size))
    if m == 1 and group_size % 8 == 0:  # whole int32 words per group
        words = qweight.view(torch.int32)
        _int4_awq_gemv_row_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
            x2, words, scales, pre_quant_scale, y, n, k, words.stride(0), scales.stride(0), ONE_BITS,
            GROUP_SIZE=group_size, **cfg, **pdl_options(x2))
        return y.reshape(*x.shape[:-1], n)
    if m == 1:
        cfg = int4_gemv_config(2, n, k, group_size)
    if cfg["BLOCK_K"] % group_size:
        raise ValueError(f"int4_awq_gemv: BLOCK_K {cfg['BLOCK_K']} must be a multiple of group_size {group_size}")
    # q * scale rounded to the activation dtype, as the reference does; float32 dots are IEEE (no TF32), and the
    # interpreter's half-precision dot is not usable.
    dot_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(x.dtype, tl.float32) if x.is_cuda \
        else tl.float32
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    x2 = x2 * pre_quant_scale.to(x.dtype)  # once, in the activation dtype, as the reference does
    _int4_awq_gemv_kernel[grid](x2, qweight, scales, y, m, n, k,
                                x2.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
                                GROUP_SIZE=group_size, DOT_DTYPE=dot_dtype, **cfg, **pdl_options(x2))
    return y.reshape(*x.shape[:-1], n)
