"""How many streaming multiprocessors a device has, for launches sized to fill the GPU."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """The SMs of a CUDA ``device``; 1 elsewhere (Triton's interpreter, where any launch size is correct)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
