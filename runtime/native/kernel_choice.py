"""Which kernels the native layers run: the part of ``RuntimeOptions`` that the model's layers consult, given to each
layer when the model is built (``DecoderModel``), never read from a global."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.runtime.options import RuntimeOptions


@dataclass(frozen=True)
class KernelChoice:
    """``triton``: the Triton kernels on CUDA tensors (else the PyTorch references everywhere); ``pdl``: their small
    launches with programmatic dependent launch; ``fp8_pv``: decode attention's p @ v in FP8 over an FP8 cache;
    ``linear_max_m``: overrides every quantized linear's streaming crossover. ``interpreted`` runs the Triton kernels
    on CPU tensors too, through triton's interpreter (``TRITON_INTERPRET=1``): how the CPU tests check the kernels
    inside the layers."""

    triton: bool = True
    pdl: bool = True
    fp8_pv: bool = True
    linear_max_m: int | None = None
    interpreted: bool = False

    @classmethod
    def from_options(cls, options: RuntimeOptions) -> KernelChoice:
        return cls(triton=options.kernels == "triton", pdl=options.pdl, fp8_pv=options.attention_fp8_pv,
                   linear_max_m=options.linear_max_m)

    def use_triton(self, x: torch.Tensor) -> bool:
        """Whether the op on ``x`` runs its Triton kernel."""
        return self.triton and (x.is_cuda or self.interpreted)

    def streams(self, x: torch.Tensor, max_m: int) -> bool:
        """Whether a quantized linear sends ``x`` to its weight-streaming kernel: Triton kernels on and 1..``max_m``
        tokens (``linear_max_m`` overrides ``max_m``)."""
        return self.use_triton(x) and 0 < x.numel() // x.shape[-1] <= (self.linear_max_m or max_m)


DEFAULT_KERNELS = KernelChoice.from_options(RuntimeOptions())  # the Triton kernels on CUDA tensors, with PDL
