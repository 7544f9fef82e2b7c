"""The gated activation of the Llama MLP: the Triton twin of ``runtime.native.layers.activation.SiluAndMul``.

For ``x = cat([gate, up], -1)`` [T, 2 * I], each program writes ``BLOCK`` columns of one row of
``silu(gate) * up`` [T, I], with the layer's roundings: ``silu(gate) = gate / (1 + exp(-gate))`` in float32
(IEEE division) rounded to the model dtype, then the product rounded again. On a GPU ``exp`` is libdevice's
``expf``, the function PyTorch's CUDA silu calls (``tl.exp`` lowers to a faster, less accurate ``ex2.approx``);
triton's interpreter cannot call libdevice, so there it is NumPy's ``exp``, which differs from PyTorch's
vectorised CPU ``exp`` by an ulp or two of float32: invisible after rounding to bfloat16, visible in float32.
With ``quant_scale`` the product is written quantized for the next FP8 linear, as
``runtime.native.kernels.rms_norm`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kiln.runtime.native.kernels.pdl import pdl_options, wait_for_previous_kernel
from kiln.runtime.native.kernels.rounding import SUPPORTED_DTYPES, quantize_e4m3, round_to_dtype

# Columns per program and warps, from tools/tune_fused_ops.py on an H200 (Llama-3-8B width, FP8 output): narrow
# programs spread a few rows over more SMs; wide ones (8 columns per thread) stream many rows.
FEW_ROWS, FEW_ROWS_LAUNCH, MANY_ROWS_LAUNCH = 64, (256, 4), (2048, 8)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, quant_scale_ptr, inter_size, stride_x, BLOCK: tl.constexpr,
                         LIBDEVICE_EXP: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    exp = libdevice.exp(-gate) if LIBDEVICE_EXP else tl.exp(-gate)
    silu = round_to_dtype(tl.math.div_rn(gate, 1.0 + exp), dtype)
    out = round_to_dtype(silu * up, dtype)
    if QUANT:
        out = quantize_e4m3(out, tl.load(quant_scale_ptr))
    tl.store(out_ptr + row * inter_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, quant_scale: torch.Tensor | None = None, block: int | None = None,
                 num_warps: int | None = None, pdl: bool = True) -> torch.Tensor:
    """``silu(gate) * up`` for x = cat([gate, up], -1) [..., 2 * I] (float32/float16/bfloat16) -> [..., I]; with
    ``quant_scale`` (float32 []) float8_e4m3fn, quantized with it. ``block`` (a power of two) columns per program
    and ``num_warps`` default by the number of rows."""
    if x.dtype not in SUPPORTED_DTYPES or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: x must be float32, float16 or bfloat16 with an even last dim, got "
                         f"{x.dtype} {list(x.shape)}")
    inter_size = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter_size)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(*x.shape[:-1], inter_size, dtype=x.dtype if quant_scale is None else torch.float8_e4m3fn,
                      device=x.device)
    if out.numel():
        default_block, default_warps = FEW_ROWS_LAUNCH if x2.shape[0] < FEW_ROWS else MANY_ROWS_LAUNCH
        block = min(block or default_block, triton.next_power_of_2(inter_size))
        grid = (x2.shape[0], triton.cdiv(inter_size, block))
        _silu_and_mul_kernel[grid](x2, out, x2 if quant_scale is None else quant_scale.reshape(()), inter_size,
                                   x2.stride(0), BLOCK=block, LIBDEVICE_EXP=x.is_cuda,
                                   QUANT=quant_scale is not None, num_warps=num_warps or default_warps,
                                   **pdl_options(x2, pdl))
    return out
