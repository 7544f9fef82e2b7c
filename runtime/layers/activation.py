"""The gated activation of the Llama MLP over the fused gate-up projection (on CUDA one Triton kernel,
``runtime.kernels.silu_mul``, unless ``KILN_KERNELS=torch``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime import kernel_config


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = cat([gate, up], -1)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_config.use_triton(x):
            from runtime.kernels.silu_mul import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
