"""RMSNorm with the residual add folded in, matching Hugging Face Llama numerics (normalise in float32).

On CUDA one Triton kernel does the add and the norm (``runtime.native.kernels.rms_norm``, same numerics) unless the
``KernelChoice`` says otherwise; given the next FP8 linear's ``quant_scale``, it also quantizes its output for that
linear.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.runtime.native.kernel_choice import DEFAULT_KERNELS, KernelChoice
from kiln.runtime.native.layers.linear import fp8_quantize


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; with ``residual`` given, first ``x = x + residual`` and return the new residual too."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 kernels: KernelChoice = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                quant_scale: torch.Tensor | None = None,
                pre_norm: RMSNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With ``quant_scale`` the output is float8_e4m3fn, ``fp8_quantize(out, quant_scale)``; with ``pre_norm``
        (same eps), ``x`` is first replaced by ``pre_norm(x)``."""
        if pre_norm is not None and pre_norm.eps != self.eps:
            raise ValueError(f"RMSNorm: a pre_norm with eps {pre_norm.eps} cannot fuse into one with eps {self.eps}")
        if self.kernels.use_triton(x):
            from kiln.runtime.native.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, quant_scale,
                            None if pre_norm is None else pre_norm.weight, pdl=self.kernels.pdl)
        if pre_norm is not None:
            x = pre_norm(x)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        out = out if quant_scale is None else fp8_quantize(out, quant_scale)
        return out if residual is None else (out, residual)
