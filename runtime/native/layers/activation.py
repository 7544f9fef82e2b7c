"""The gated activations of the MLP over the fused gate-up projection: SwiGLU (on CUDA one Triton kernel,
``runtime.native.kernels.silu_mul``, as the ``KernelChoice`` says) and GeGLU with tanh GELU (Gemma 2; PyTorch ops),
each output optionally quantized for an FP8 linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.runtime.native.kernel_choice import DEFAULT_KERNELS, KernelChoice
from kiln.runtime.native.layers.linear import fp8_quantize


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = cat([gate, up], -1)``."""

    def __init__(self, kernels: KernelChoice = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor, quant_scale: torch.Tensor | None = None) -> torch.Tensor:
        """With ``quant_scale`` the output is float8_e4m3fn, ``fp8_quantize(out, quant_scale)``."""
        if self.kernels.use_triton(x):
            from kiln.runtime.native.kernels.silu_mul import silu_and_mul

            return silu_and_mul(x, quant_scale, pdl=self.kernels.pdl)
        gate, up = x.chunk(2, dim=-1)
        out = F.silu(gate) * up
        return out if quant_scale is None else fp8_quantize(out, quant_scale)


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` for ``x = cat([gate, up], -1)`` (transformers' ``gelu_pytorch_tanh``)."""

    def forward(self, x: torch.Tensor, quant_scale: torch.Tensor | None = None) -> torch.Tensor:
        """With ``quant_scale`` the output is float8_e4m3fn, ``fp8_quantize(out, quant_scale)``."""
        gate, up = x.chunk(2, dim=-1)
        out = F.gelu(gate, approximate="tanh") * up
        return out if quant_scale is None else fp8_quantize(out, quant_scale)


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# transformers' other names for the same functions (its ACT2FN): the engine records the canonical one
ACTIVATION_ALIASES = {"swish": "silu", "gelu_new": "gelu_pytorch_tanh"}


def gated_activation(name: str, kernels: KernelChoice) -> nn.Module:
    """The gated activation of ``Architecture.hidden_act`` ``name`` (one of ``ACTIVATIONS``)."""
    return SiluAndMul(kernels) if name == "silu" else GeluTanhAndMul()
