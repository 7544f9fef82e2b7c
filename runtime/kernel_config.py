"""Which kernels the runtime runs on a CUDA device; read once from the environment when the runtime is imported.

- ``KILN_KERNELS``: ``triton`` (default) runs the Triton kernels of ``runtime.native.kernels`` on CUDA tensors (paged
  attention, the KV store, RMSNorm, RoPE, SiLU-and-multiply, and the weight-streaming FP8 / INT4 linears for small
  batches); ``torch`` runs the plain PyTorch references everywhere. CPU tensors always take the references.
- ``KILN_LINEAR_MAX_M``: the largest number of tokens a quantized linear sends to its weight-streaming kernel, for
  every shape; unset, each linear uses the crossover measured for its shape (``runtime.native.layers.linear``).
  Larger calls take the GEMM path (``torch._scaled_mm`` for FP8).
- ``KILN_CUDA_GRAPHS``: ``1`` (default) captures CUDA graphs at load on CUDA, for decode steps per batch-size bucket
  and for single-sequence prefill steps per token-count bucket; ``0`` runs every step eagerly. Graphs need the Triton
  kernels (the reference attention reads lengths on the host).
- ``KILN_OVERLAP_STEPS``: ``1`` (default) lets the engine queue the next step on the device before it reads the
  current step's tokens, feeding them to it on the device, so that the host's scheduling and
  postprocessing overlap the device's work; ``0`` runs each step to completion first.
- ``KILN_PDL``: ``1`` (default) launches the Triton kernels of small batches (up to 16 tokens) with programmatic
  dependent launch on devices of compute capability 9.0 and later, so that each is scheduled while the one before
  it finishes (``runtime.native.kernels.pdl``); ``0`` launches every kernel one after the other as usual.
"""

from __future__ import annotations

import os

import torch
from kiln.runtime.errors import KilnError


class KernelConfigError(KilnError):
    """A KILN_* kernel variable is set to a value the runtime cannot run."""


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in allowed:
        raise KernelConfigError(f"{name}={value!r} must be one of {', '.join(allowed)}; unset it for {default!r}")
    return value


def _positive_int_or_none(name: str) -> int | None:
    value = os.environ.get(name)
    if value is not None and (not value.isdigit() or int(value) < 1):
        raise KernelConfigError(f"{name}={value!r} must be a positive integer; unset it for the measured default")
    return None if value is None else int(value)


KERNELS = _choice("KILN_KERNELS", "triton", ("triton", "torch"))
LINEAR_MAX_M = _positive_int_or_none("KILN_LINEAR_MAX_M")
CUDA_GRAPHS_SETTING = os.environ.get("KILN_CUDA_GRAPHS")  # None: the default (on where the Triton kernels run)
_choice("KILN_CUDA_GRAPHS", "1", ("0", "1"))
OVERLAP_STEPS = _choice("KILN_OVERLAP_STEPS", "1", ("0", "1")) == "1"
PDL = _choice("KILN_PDL", "1", ("0", "1")) == "1"


def use_triton(x: torch.Tensor) -> bool:
    """Whether the op on ``x`` runs its Triton kernel: ``KILN_KERNELS=triton`` and a CUDA tensor."""
    return KERNELS == "triton" and x.is_cuda


def cuda_graphs_enabled() -> bool:
    """Whether decode and prefill CUDA graphs are captured on a CUDA device; an explicit ``KILN_CUDA_GRAPHS=1``
    together with ``KILN_KERNELS=torch`` is refused, the default simply stays eager there."""
    if CUDA_GRAPHS_SETTING == "0":
        return False
    if KERNELS != "triton":
        if CUDA_GRAPHS_SETTING == "1":
            raise KernelConfigError("KILN_CUDA_GRAPHS=1 needs KILN_KERNELS=triton (the reference attention reads "
                                    "lengths on the host and cannot be captured): unset KILN_KERNELS, or set "
                                    "KILN_CUDA_GRAPHS=0")
        return False
    return True
