"""Buckets, step staging and capture of one CUDA graph per bucket of a static-buffer forward, shared by the decode and
prefill graph runners."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

Key = TypeVar("Key")  # a bucket: its size, or a tuple that starts with it


def doubling_sizes(first: int, limit: int) -> tuple[int, ...]:
    """``first``, ``2 * first``, ... below ``limit``, then ``limit`` itself (alone when ``limit <= first``)."""
    sizes, size = [], first
    while size < limit:
        sizes.append(size)
        size *= 2
    return (*sizes, limit)


def smallest_bucket(sizes: tuple[int, ...], n: int, unit: str, kind: str) -> int:
    """The smallest of the sorted ``sizes`` that holds ``n`` ``unit`` (the error names the ``kind`` of graph)."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} {unit} exceed the largest {kind} graph bucket ({sizes[-1]})")


class StepStaging:
    """A step's metadata in two pinned host buffers (int64 and int32) and their static device twins, reaching the
    device in one copy each. The host buffers are rewritten only once the previous step's copies are done (an event):
    a step may be staged while the previous one is still queued on the device (a prefill chunk that samples nothing
    is not waited for; the engine overlaps decode steps)."""

    def __init__(self, i64_shape: tuple[int, ...], i32_size: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host_i64 = torch.zeros(i64_shape, dtype=torch.int64, pin_memory=pinned)
        self.host_i32 = torch.zeros(i32_size, dtype=torch.int32, pin_memory=pinned)
        self.dev_i64 = torch.zeros_like(self.host_i64, device=device)
        self.dev_i32 = torch.zeros_like(self.host_i32, device=device)
        self._copied = torch.cuda.Event() if pinned else None

    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """The host buffers to write, as arrays, once the previous step's copies are done."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.host_i64.numpy(), self.host_i32.numpy()

    def upload(self) -> None:
        """Queue the copies of the host buffers to the device buffers."""
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        self.dev_i32.copy_(self.host_i32, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


@torch.inference_mode()
def capture_graphs(device: torch.device, keys: tuple[Key, ...], forward: Callable[[Key], torch.Tensor],
                   ) -> tuple[dict[Key, torch.cuda.CUDAGraph], dict[Key, torch.Tensor]]:
    """Warm ``forward(key)`` up eagerly for every key (compiling its kernels) on a side stream, then capture each,
    largest key first (the biggest buffers: keys sort by size), into one memory pool. Returns the graphs and their
    output tensors."""
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for key in keys:
            forward(key)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = {}, {}
    for key in sorted(keys, reverse=True):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[key] = forward(key)
        graphs[key] = graph
    torch.cuda.synchronize(device)
    return graphs, outputs
