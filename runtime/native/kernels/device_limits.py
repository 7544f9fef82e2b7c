"""What a device gives a kernel launch: its SMs (for grids sized to fill the GPU) and the shared memory one program
may claim (for pipelines as deep as it holds)."""

from __future__ import annotations

import functools

import torch
import triton


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
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"] - 8192
