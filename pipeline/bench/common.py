"""Small helpers every part of ``kiln bench`` shares: device synchronisation, freeing memory, rates."""

from __future__ import annotations

import gc

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device | str) -> None:
    """Collect garbage and return the allocator's cached blocks, so what was freed is free for the next phase."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def rate(tokens: int, seconds: float) -> float:
    """Tokens per second, rounded; infinite for a zero duration."""
    return round(tokens / seconds, 2) if seconds > 0 else float("inf")
