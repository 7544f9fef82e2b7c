"""RMSNorm with the residual add folded in: the Triton twin of ``runtime.native.layers.norm.RMSNorm.forward``.

One program per token row holds the whole row (``BLOCK = next_power_of_2(hidden_size)``, up to 8192 and beyond)
in registers, so the row is read once, reduced once and written once: with a residual, ``x + residual`` is rounded
to the model dtype and written out as the new residual, then normalised in float32, rounded to the model dtype and
scaled by ``weight``, the product rounded again, exactly the roundings the PyTorch layer makes. The only numerical
difference is the order of the float32 sum of squares (and, on a GPU, the approximate ``rsqrt`` of each side, and
PyTorch's CUDA mean multiplying by ``1 / hidden`` where this kernel divides, as PyTorch's CPU mean does).

With ``pre_weight`` (Gemma 2's sandwich norms), ``x`` is first normalised on its own by that weight, with the same
roundings, before the residual add: the post-norm of one sub-layer and the pre-norm of the next in one kernel.

With ``quant_scale`` the output is instead that model-dtype value quantized for the next FP8 linear,
``fp8_e4m3(clamp(out / quant_scale, ±448))`` (the bytes ``runtime.native.kernels.fp8_quant`` would write from it), which
saves that linear a kernel and a round trip of the activations through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.kernels.pdl import pdl_options, wait_for_previous_kernel
from kiln.runtime.native.kernels.rounding import SUPPORTED_DTYPES, multiply_rounded, quantize_e4m3, round_to_dtype


@triton.jit
def _normalize(x, weight_ptr, cols, mask, eps, HIDDEN: tl.constexpr, dtype: tl.constexpr):
    """``round(weight * round(x / rms(x)))`` of a float32 row, rounded as the PyTorch layer rounds (the product
    too, when a residual add follows in the same kernel)."""
    variance = tl.math.div_rn(tl.sum(x * x, axis=0), HIDDEN)
    h = round_to_dtype(x * tl.math.rsqrt(variance + eps), dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return round_to_dtype(multiply_rounded(weight, h), dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, pre_weight_ptr, out_ptr, new_residual_ptr, quant_scale_ptr,
                     eps, stride_x, stride_r, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, PRE_NORM: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if PRE_NORM:
        x = _normalize(x, pre_weight_ptr, cols, mask, eps, HIDDEN, dtype)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = round_to_dtype(x + residual, dtype)
        tl.store(new_residual_ptr + row * HIDDEN + cols, x.to(dtype), mask=mask)
    out = _normalize(x, weight_ptr, cols, mask, eps, HIDDEN, dtype)
    if QUANT:
        out = quantize_e4m3(out, tl.load(quant_scale_ptr))
    tl.store(out_ptr + row * HIDDEN + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    """A warp per 256 elements of the row, 4 to 16: 16 for a 4096-wide row was the fastest on an H200 at 1, 256 and
    1000 rows (tools/tune_fused_ops.py)."""
    return min(16, max(4, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quant_scale: torch.Tensor | None = None, pre_weight: torch.Tensor | None = None,
             num_warps: int | None = None, pdl: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)`` over the last dim of x [..., hidden] (float32/float16/bfloat16); ``weight``
    [hidden] has x's dtype. With ``residual`` (x's shape and dtype), first ``x = x + residual`` and return
    ``(out, new_residual)``, the new residual a fresh tensor: neither input is written. With ``quant_scale``
    (float32 []), ``out`` is float8_e4m3fn, quantized with it. With ``pre_weight`` (like ``weight``), x is first
    replaced by ``rms_norm(x, pre_weight, eps)``, in the same kernel. ``num_warps`` per row (default: by hidden size).
    """
    hidden = x.shape[-1]
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"rms_norm: x must be float32, float16 or bfloat16, got {x.dtype}")
    for name, w in (("weight", weight), ("pre_weight", pre_weight)):
        if w is not None and (w.shape != (hidden,) or w.dtype != x.dtype):
            raise ValueError(f"rms_norm: {name} must be {x.dtype} [{hidden}], got {w.dtype} {list(w.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual must be {x.dtype} {list(x.shape)}, got {residual.dtype} "
                         f"{list(residual.shape)}")
    x2 = x.reshape(-1, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = x2 if residual is None else residual.reshape(-1, hidden)
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    weight = weight.contiguous()
    pre_norm = pre_weight is not None
    pre_weight = pre_weight.contiguous() if pre_norm else weight
    out = torch.empty(x.shape, dtype=x.dtype if quant_scale is None else torch.float8_e4m3fn, device=x.device)
    new_residual = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, pre_weight, out, x2 if new_residual is None else new_residual,
            weight if quant_scale is None else quant_scale.reshape(()), eps, x2.stride(0), r2.stride(0),
            HIDDEN=hidden, BLOCK=block, PRE_NORM=pre_norm, HAS_RESIDUAL=residual is not None,
            QUANT=quant_scale is not None,
            num_warps=num_warps or _num_warps(block), **pdl_options(x2, pdl))
    return out if new_residual is None else (out, new_residual)
