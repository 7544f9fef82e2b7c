"""The gated activation of the Llama MLP over the fused gate-up projection (on CUDA one Triton kernel,
``runtime.native.kernels.silu_mul``, unless ``KILN_KERNELS=torch``), its output optionally quantized for an FP8
linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kiln.runtime import kernel_config
from kiln.runtime.native.layers.linear import fp8_quantize
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = cat([gate, up], -1)``."""

    def forward(self, x: torch.Tensor, quant_scale: torch.Tensor | None = None) -> torch.Tensor:
        """With ``quant_scale`` the output is float8_e4m3fn, ``fp8_quantize(out, quant_scale)``."""
        if kernel_config.use_triton(x):
            from kiln.runtime.native.kernels.silu_mul import silu_and_mul

            return silu_and_mul(x, quant_scale)
        gate, up = x.chunk(2, dim=-1)
        out = F.silu(gate) * up
        return out if quant_scale is None else fp8_quantize(out, quant_scale)
