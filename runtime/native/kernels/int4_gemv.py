"""Weight-streaming INT4-AWQ (W4A16) linear for small batches: ``y = (x * pre_quant_scale) @ (q * scales)^T``.

The layout is ``runtime.native.layers.linear``'s: ``qweight`` uint8 [N, K // 2], byte j of row n holds input columns 2j
(low nibble) and 2j + 1 (high nibble) as ``q + 8``; ``scales`` float32 [N, K // group_size]; ``pre_quant_scale``
float32 [K]. Group sizes are powers of two from 32 (AWQ's 32, 64 and 128); ``Int4AwqLinear`` dequantizes for other
sizes. Each program owns ``BLOCK_N`` output rows and walks K in steps of ``GROUPS`` whole groups, loading the packed
bytes and their scales once and splitting the nibbles in registers; a nibble becomes a float by bit arithmetic
rather than an integer-to-float conversion, which runs at a quarter of the FMA rate. The kernels sum ``q * x`` per
group and multiply each group's sum by its scale once, in float32:

- M = 1 (``_int4_awq_gemv_row_kernel``) reads the bytes as int32 words, three instructions a weight, and multiplies
  the activation by ``pre_quant_scale`` as it loads it (rounded to the activation dtype, the bytes of the
  reference's multiply, without a kernel of its own).
- M = 2 (``_int4_awq_gemv_rows_kernel``) does the same for a tile of tokens, each nibble turned into a float once for
  all of them: a layer's linears took 101 us against 130 for the ``tl.dot`` kernel on an H200. It is the M = 1
  kernel generalised, but with a token dimension of one it ran 26-60 % slower than that kernel; from 4 tokens the
  dot is faster for all but the narrowest linear.
- 3-16 tokens (``_int4_awq_group_dot_kernel``) take the activation already multiplied (every program redoing it on
  each tile made batch-8 decode 29 % slower on an H200) and run one ``tl.dot`` per group on the unscaled ``q - 8``,
  exact in the activation dtype. Dequantizing the tile and rounding ``q * scale`` before the dot, as
  ``int4_awq_linear_reference`` does, made a Llama-3-8B layer's linears 25 % slower on an H200; the products
  differ from the reference by its rounding of the weight (a few 1e-3 of the output's range in bfloat16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.kernels.pdl import pdl_options, wait_for_previous_kernel
from kiln.runtime.native.kernels.rounding import TRITON_DTYPES


@triton.jit
def nibble_value(nibble):
    """``nibble - 8`` as float32 for int32 ``nibble`` in 0..15: 0x4B000000 | n is the float 2**23 + n, exactly."""
    return (nibble | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def scaled_activation(x_ptrs, pqs_ptrs, mask):
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
def _nibbles_times(w, one, x0, x1, x2, x3, x4, x5, x6, x7):
    """``sum_i (1 + n_i / 16) * x_i`` over the 8 nibbles n_i of the int32 words ``w`` (low nibble first), each
    ``x_i`` the activations of column i of every word, broadcast against ``w`` as given: a shift, a LOP3 and an
    FFMA a weight and a token."""
    s = _one_plus_sixteenth(w, one, 0) * x0
    s += _one_plus_sixteenth(w, one, 4) * x1
    s += _one_plus_sixteenth(w, one, 8) * x2
    s += _one_plus_sixteenth(w, one, 12) * x3
    s += _one_plus_sixteenth(w, one, 16) * x4
    s += _one_plus_sixteenth(w, one, 20) * x5
    s += _one_plus_sixteenth(w, one, 24) * x6
    s += _one_plus_sixteenth(w, one, 28) * x7
    return s


@triton.jit
def columns_of_words(x, WORDS: tl.constexpr):
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
def _columns_of_word_rows(x, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """x [ROWS, WORDS * 8] as eight [ROWS, WORDS] tensors: column 8w + i of each word w, for i = 0..7. The batch-1
    kernel keeps the one-dimensional ``columns_of_words``: through this one (ROWS = 1) it compiled for sm_90 to 22-34 %
    more instructions (shuffles and barriers of layout conversions)."""
    a, b = tl.split(tl.reshape(x, [ROWS, WORDS, 4, 2]))  # i = 0, 2, 4, 6 and 1, 3, 5, 7
    a0, a1 = tl.split(tl.reshape(a, [ROWS, WORDS, 2, 2]))  # 0, 4 and 2, 6
    b0, b1 = tl.split(tl.reshape(b, [ROWS, WORDS, 2, 2]))  # 1, 5 and 3, 7
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def accumulate_int4_rows(acc, w, scale, columns, x_sum, one, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """``acc`` [rows] plus one step of the batch-1 kernel: the int32 words ``w`` [rows, WORDS] (GROUPS whole groups
    of each row) against the activation's ``columns`` (``columns_of_words``) and its per-group sums ``x_sum``
    [GROUPS], each group's sum times its ``scale`` [rows, GROUPS]."""
    x0, x1, x2, x3, x4, x5, x6, x7 = columns
    s = _nibbles_times(w, one, x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :], x5[None, :],
                       x6[None, :], x7[None, :])
    f_x = tl.sum(tl.reshape(s, [w.shape[0], GROUPS, GROUP_SIZE // 8]), axis=2)  # [rows, GROUPS]
    return acc + tl.sum(scale * (16.0 * f_x - 24.0 * x_sum[None, :]), axis=1)


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
        x = scaled_activation(x_ptr + k0 + cols, pqs_ptr + k0 + cols, cols < K - k0)
        columns = columns_of_words(x, WORDS)
        x_sum = tl.sum(tl.reshape(x, [GROUPS, GROUP_SIZE]), axis=1)
        groups = k0 // GROUP_SIZE + offs_g
        scale = tl.load(scales_ptr + offs_n[:, None] * stride_sn + groups[None, :],
                        mask=mask_n[:, None] & (groups < K // GROUP_SIZE)[None, :], other=0.0)
        acc = accumulate_int4_rows(acc, w, scale, columns, x_sum, one, GROUPS, GROUP_SIZE)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _int4_awq_gemv_rows_kernel(x_ptr, qw_ptr, scales_ptr, pqs_ptr, y_ptr, M, N, K: tl.constexpr, stride_xm, stride_qn,
                              stride_sn, stride_ym, one, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr):
    """A few tokens over the packed weight read as int32 words (8 nibbles: columns 8w .. 8w + 7, low nibble first):
    each step covers GROUPS whole groups of BLOCK_N rows for all BLOCK_M tokens. Each nibble n becomes
    ``f = 1 + n / 16`` with one shift and one LOP3, once for every token, and ``sum_k (n_k - 8) x_k = 16 sum_k f_k
    x_k - 24 sum_k x_k`` per group, so a weight costs a shift, a LOP3 and an FFMA a token (the byte-wise form took
    1.5x the instructions per byte at one token, compiled for sm_90)."""
    wait_for_previous_kernel(PDL)
    WORDS: tl.constexpr = GROUPS * GROUP_SIZE // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    offs_w = tl.arange(0, WORDS)
    offs_g = tl.arange(0, GROUPS)
    cols = tl.arange(0, WORDS * 8)  # the step's input columns
    qw_rows = qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    x_rows = x_ptr + offs_m[:, None] * stride_xm + cols[None, :]
    pqs_rows = pqs_ptr + offs_m[:, None] * 0 + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, WORDS * 8):
        words = k0 // 8 + offs_w
        w = tl.load(qw_rows + words[None, :], mask=mask_n[:, None] & (words < K // 8)[None, :], other=0)[None, :, :]
        x = scaled_activation(x_rows + k0, pqs_rows + k0, mask_m[:, None] & (cols < K - k0)[None, :])
        x0, x1, x2, x3, x4, x5, x6, x7 = _columns_of_word_rows(x, BLOCK_M, WORDS)  # [BLOCK_M, WORDS] each
        s = _nibbles_times(w, one, x0[:, None, :], x1[:, None, :], x2[:, None, :], x3[:, None, :], x4[:, None, :],
                           x5[:, None, :], x6[:, None, :], x7[:, None, :])  # [BLOCK_M, BLOCK_N, WORDS]
        f_x = tl.sum(tl.reshape(s, [BLOCK_M, BLOCK_N, GROUPS, GROUP_SIZE // 8]), axis=3)
        x_sum = tl.sum(tl.reshape(x, [BLOCK_M, GROUPS, GROUP_SIZE]), axis=2)
        groups = k0 // GROUP_SIZE + offs_g
        scale = tl.load(scales_ptr + offs_n[:, None] * stride_sn + groups[None, :],
                        mask=mask_n[:, None] & (groups < K // GROUP_SIZE)[None, :], other=0.0)
        acc += tl.sum(scale[None, :, :] * (16.0 * f_x - 24.0 * x_sum[:, None, :]), axis=2)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _int4_awq_group_dot_kernel(x_ptr, qw_ptr, scales_ptr, y_ptr, M, N, K: tl.constexpr,
                               stride_xm, stride_qn, stride_sn, stride_ym,
                               GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               GROUPS: tl.constexpr, DOT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    """2-16 tokens: per group, the even and odd input columns of x against the low and high nibbles' ``q - 8`` (two
    ``tl.dot`` of K = GROUP_SIZE / 2), the [BLOCK_M, BLOCK_N] sum scaled by the group's scales. GROUPS divides the
    number of groups."""
    wait_for_previous_kernel(PDL)
    GROUP_BYTES: tl.constexpr = GROUP_SIZE // 2
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    qw_rows = qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + tl.arange(0, GROUP_BYTES)[None, :]
    x_rows = x_ptr + offs_m[:, None] * stride_xm + tl.arange(0, GROUP_SIZE)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first_group in range(0, K // GROUP_SIZE, GROUPS):
        for i in tl.static_range(GROUPS):
            group = first_group + i
            packed = tl.load(qw_rows + group * GROUP_BYTES, mask=mask_n[:, None], other=0x88).to(tl.int32)
            x = tl.load(x_rows + group * GROUP_SIZE, mask=mask_m[:, None], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, GROUP_BYTES, 2]))
            q_even = nibble_value(packed & 0x0F).to(DOT_DTYPE)
            q_odd = nibble_value(packed >> 4).to(DOT_DTYPE)
            if tl.float32 == DOT_DTYPE:
                part = tl.dot(x_even.to(tl.float32), tl.trans(q_even), input_precision="ieee")
                part = tl.dot(x_odd.to(tl.float32), tl.trans(q_odd), part, input_precision="ieee")
            else:
                part = tl.dot(x_even.to(DOT_DTYPE), tl.trans(q_even))
                part = tl.dot(x_odd.to(DOT_DTYPE), tl.trans(q_odd), part)
            scale = tl.load(scales_ptr + offs_n * stride_sn + group, mask=mask_n, other=0.0)
            acc += part * scale[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


ONE_BITS = 0x3F800000  # the float 1.0
ROW_REDUCE_MAX_M = 2  # a config of a tile of at most this many tokens runs the rows kernel; larger ones a tl.dot


def int4_gemv_config(m: int, n: int, k: int, group_size: int) -> dict:
    """Launch parameters, the fastest of sweeps on an H200 inside CUDA graphs over Llama-3-8B's shapes
    (tools/tune_gemv.py). M = 1: 16 rows by 2048 input columns (4096 where the grid is small or the rows long) per
    step, so that a program has 16 KB or more of weight in flight. 2 tokens: 16 rows (8 past 4096 input features)
    by 2048 columns (4096 for a square 4096 linear). 3-16 tokens: a 16-token tile of 32 rows (64 past 4096) by 512
    input columns (256 for the widest linears, fewer where that does not divide a row) per step."""
    if m == 1:
        small_grid, long_rows = n <= 4096, k > 4096
        columns = 4096 if small_grid or long_rows else 2048
        return dict(BLOCK_N=16, GROUPS=max(1, columns // group_size), num_warps=8 if n <= 8192 and not long_rows else 4,
                    num_stages=1)
    if m <= ROW_REDUCE_MAX_M:
        columns = 4096 if n <= 4096 and k <= 4096 else 2048
        return dict(BLOCK_M=m, BLOCK_N=16 if k <= 4096 else 8, GROUPS=max(1, columns // group_size), num_warps=8,
                    num_stages=1)
    groups = max(1, (256 if n >= 16384 else 512) // group_size)
    while (k // group_size) % groups:
        groups //= 2
    return dict(BLOCK_M=16, BLOCK_N=64 if n > 4096 else 32, GROUPS=groups, num_warps=4, num_stages=3)


def supports_group_size(group_size: int) -> bool:
    """Whether the streaming kernels serve INT4 groups of ``group_size`` input columns: a power of two from 32 (a
    group's dot needs 16 or more columns of each parity)."""
    return group_size >= 32 and group_size & (group_size - 1) == 0


def int4_awq_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pre_quant_scale: torch.Tensor,
                  group_size: int = 128, config: dict | None = None, pdl: bool = True) -> torch.Tensor:
    """INT4-AWQ linear for small M: x [..., K] (float32/float16/bfloat16), qweight uint8 [N, K // 2],
    scales float32 [N, K // group_size], pre_quant_scale float32 [K]. Returns [..., N] in ``x.dtype``."""
    x2, qweight, scales, pre_quant_scale = int4_gemv_operands("int4_awq_gemv", x, qweight, scales, pre_quant_scale,
                                                              group_size)
    (m, k), n = x2.shape, qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = dict(config or int4_gemv_config(m, n, k, group_size))
    words = qweight.view(torch.int32)  # the batch-1 and two-token kernels' view
    if m == 1:
        _int4_awq_gemv_row_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
            x2, words, scales, pre_quant_scale, y, n, k, words.stride(0), scales.stride(0), ONE_BITS,
            GROUP_SIZE=group_size, **cfg, **pdl_options(x2, pdl))
        return y.reshape(*x.shape[:-1], n)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    if cfg["BLOCK_M"] <= ROW_REDUCE_MAX_M:
        _int4_awq_gemv_rows_kernel[grid](
            x2, words, scales, pre_quant_scale, y, m, n, k, x2.stride(0), words.stride(0), scales.stride(0),
            y.stride(0), ONE_BITS, GROUP_SIZE=group_size, **cfg, **pdl_options(x2, pdl))
        return y.reshape(*x.shape[:-1], n)
    if (k // group_size) % cfg["GROUPS"]:
        raise ValueError(f"int4_awq_gemv: GROUPS {cfg['GROUPS']} must divide the {k // group_size} groups of a row")
    # float32 dots are IEEE (no TF32), and the interpreter's half-precision dot is not usable
    dot_dtype = TRITON_DTYPES.get(x.dtype, tl.float32) if x.is_cuda else tl.float32
    x2 = x2 * pre_quant_scale.to(x.dtype)  # once, in the activation dtype, as the reference does
    _int4_awq_group_dot_kernel[grid](x2, qweight, scales, y, m, n, k,
                                     x2.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
                                     GROUP_SIZE=group_size, DOT_DTYPE=dot_dtype, **cfg, **pdl_options(x2, pdl))
    return y.reshape(*x.shape[:-1], n)


def int4_gemv_operands(caller: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       pre_quant_scale: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """The checked operands of an INT4 streaming kernel: x's rows [M, K], qweight, scales and pre_quant_scale, each
    with a unit last stride."""
    n, half_k = qweight.shape
    k = 2 * half_k
    if not supports_group_size(group_size):
        raise ValueError(f"{caller}: group_size must be a power of two from 32, got {group_size}")
    if qweight.dtype != torch.uint8 or x.shape[-1] != k or k % group_size:
        raise ValueError(f"{caller}: qweight must be uint8 [N, {x.shape[-1] // 2}] with K a multiple of "
                         f"group_size {group_size}, got {qweight.dtype} {list(qweight.shape)}")
    if scales.shape != (n, k // group_size) or pre_quant_scale.shape != (k,):
        raise ValueError(f"{caller}: scales must be [{n}, {k // group_size}] and pre_quant_scale [{k}], "
                         f"got {list(scales.shape)} and {list(pre_quant_scale.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scales = scales if scales.stride(-1) == 1 else scales.contiguous()
    pre_quant_scale = pre_quant_scale.contiguous()
    return x2, qweight, scales, pre_quant_scale
