"""Static-scale FP8 activation quantization: ``fp8_e4m3(clamp(x / scale, ±448))`` in one pass over ``x``.

The Triton twin of ``runtime.native.layers.linear.fp8_quantize`` (same bytes: IEEE division, round to nearest even). Its
output feeds both FP8 linear paths: the weight-streaming kernel for small batches and ``torch._scaled_mm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.kernels.pdl import pdl_options, wait_for_previous_kernel
from kiln.runtime.native.kernels.rounding import quantize_e4m3

BLOCK = 1024


@triton.jit
def _quantize_fp8_kernel(x_ptr, scale_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    y = quantize_e4m3(x, tl.load(scale_ptr))
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """x [..., K] (float32/float16/bfloat16) and a float32 scale [] -> float8_e4m3fn [M, K] (leading dims flattened)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if x2.numel():
        _quantize_fp8_kernel[(x2.shape[0], triton.cdiv(k, BLOCK))](x2, scale.reshape(()), out, k, x2.stride(0),
                                                                   out.stride(0), BLOCK=BLOCK, **pdl_options(x2, pdl))
    return out
