"""What a device gives a kernel launch: its SMs (for grids sized to fill the GPU), the shared memory one program
may claim (for pipelines as deep as it holds), and the features of its compute capability the kernels use."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """The SMs of a CUDA ``device``; 1 elsewhere (Triton's interpreter, where any launch size is correct)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def program_shared_memory(device: torch.device) -> int:
    """The shared memory a program may claim on a CUDA ``device``, less 8 KB for the compiler's own (reductions,
    layout conversions)."""
    import triton  # here, not above: the layers ask this module about FP8 and import no Triton until they run it

    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"] - 8192


@functools.cache
def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Whether a CUDA ``device`` multiplies FP8 on its tensor cores (compute capability 8.9, Ada, and newer)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def supports_pdl(device: torch.device) -> bool:
    """Whether a CUDA ``device`` has programmatic dependent launch (compute capability 9.0, Hopper, and newer)."""
    return torch.cuda.get_device_capability(device) >= (9, 0)
