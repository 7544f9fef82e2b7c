"""The gated activation of the Llama MLP: the Triton twin of ``runtime.layers.activation.SiluAndMul``.

For ``x = cat([gate, up], -1)`` [T, 2 * I], each program writes ``BLOCK`` columns of one row of
``silu(gate) * up`` [T, I], with the layer's roundings: ``silu(gate) = gate / (1 + exp(-gate))`` in float32
(IEEE division) rounded to the model dtype, then the product rounded again. On a GPU ``exp`` is libdevice's
``expf``, the function PyTorch's CUDA silu calls (``tl.exp`` lowers to a faster, less accurate ``ex2.approx``);
triton's interpreter cannot call libdevice, so there it is NumPy's ``exp``, which differs from PyTorch's
vectorised CPU ``exp`` by an ulp or two of float32: invisible after rounding to bfloat16, visible in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from runtime.kernels.rounding import SUPPORTED_DTYPES, round_to_dtype

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter_size, stride_x, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    exp = libdevice.exp(-gate) if LIBDEVICE_EXP else tl.exp(-gate)
    silu = round_to_dtype(tl.math.div_rn(gate, 1.0 + exp), dtype)
    tl.store(out_ptr + row * inter_size + cols, round_to_dtype(silu * up, dtype).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for x = cat([gate, up], -1) [..., 2 * I] (float32/float16/bfloat16) -> [..., I]."""
    if x.dtype not in SUPPORTED_DTYPES or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: x must be float32, float16 or bfloat16 with an even last dim, got "
                         f"{x.dtype} {list(x.shape)}")
    inter_size = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter_size)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(*x.shape[:-1], inter_size, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(BLOCK, triton.next_power_of_2(inter_size))
        grid = (x2.shape[0], triton.cdiv(inter_size, block))
        _silu_and_mul_kernel[grid](x2, out, inter_size, x2.stride(0), BLOCK=block, LIBDEVICE_EXP=x.is_cuda,
                                   num_warps=4)
    return out
