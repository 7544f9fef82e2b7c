"""INT4-AWQ weight dequantization for large batches: the packed weight becomes a dense one in the activation dtype,
for a cuBLAS GEMM, in one pass (0.5 byte read and 2 bytes written per weight).

Same layout and numerics as ``runtime.layers.linear.int4_dequantize(...).to(dtype)``: each output element is
``(q - 8) * scale`` computed in float32 and rounded to nearest-even in the target dtype (``rounding.round_to_dtype``,
exact in Triton's interpreter too). Each program writes ``BLOCK_N`` rows by ``2 * BLOCK_J`` columns: byte j of a row
gives its even (low nibble) and odd (high nibble) column, interleaved in registers so the stores are contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.int4_gemv import nibble_value
from runtime.kernels.rounding import SUPPORTED_DTYPES, round_to_dtype

BLOCK_N, BLOCK_J = 16, 128


@triton.jit
def _int4_dequantize_kernel(qw_ptr, scales_ptr, out_ptr, N, HALF_K, stride_qn, stride_sn, stride_on,
                            GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    mask = (offs_n < N)[:, None] & (offs_j < HALF_K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    packed = tl.load(qw_ptr + rows * stride_qn + offs_j[None, :], mask=mask, other=0x88)
    scale = tl.load(scales_ptr + rows * stride_sn + (2 * offs_j // GROUP_SIZE)[None, :], mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    packed = packed.to(tl.int32)
    even = round_to_dtype(nibble_value(packed & 0x0F) * scale, dtype)
    odd = round_to_dtype(nibble_value(packed >> 4) * scale, dtype)
    # interleaved in registers, so each row's columns are stored contiguously; the column offsets are an arange (the
    # same values as interleaving 2j and 2j + 1), which the compiler knows to be contiguous and stores vectorised
    cols = tl.program_id(1) * 2 * BLOCK_J + tl.arange(0, 2 * BLOCK_J)
    weight = tl.reshape(tl.join(even, odd), [BLOCK_N, 2 * BLOCK_J])
    tl.store(out_ptr + rows * stride_on + cols[None, :], weight.to(dtype),
             mask=(offs_n < N)[:, None] & (cols < 2 * HALF_K)[None, :])


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """qweight uint8 [N, K // 2] and scales float32 [N, K // group_size] -> the weight [N, K] in ``dtype``."""
    n, half_k = qweight.shape
    if qweight.dtype != torch.uint8 or group_size % 2 or scales.shape != (n, 2 * half_k // group_size):
        raise ValueError(f"int4_dequantize: qweight must be uint8 [N, K // 2] and scales [N, K // {group_size}], "
                         f"got {qweight.dtype} {list(qweight.shape)} and {list(scales.shape)}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"int4_dequantize: dtype must be float32, float16 or bfloat16, got {dtype}")
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scales = scales if scales.stride(-1) == 1 else scales.contiguous()
    out = torch.empty(n, 2 * half_k, dtype=dtype, device=qweight.device)
    if out.numel():
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(half_k, BLOCK_J))
        _int4_dequantize_kernel[grid](qweight, scales, out, n, half_k, qweight.stride(0), scales.stride(0),
                                      out.stride(0), GROUP_SIZE=group_size, BLOCK_N=BLOCK_N, BLOCK_J=BLOCK_J)
    return out
