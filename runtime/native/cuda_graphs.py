"""Buckets, step staging and the CUDA graphs of a static-buffer forward, one per bucket, captured when first needed;
shared by the decode and prefill graph runners."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

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
    """A step's metadata in one pinned host buffer, int64 values then int32 ones, and its static device twin, reaching
    the device in one copy (a copy costs the GPU a few microseconds whatever its size; a decode step's ran 4-8 us
    apart on an H200). The host buffer is rewritten only once the previous step's copy is done (an event): a step
    may be staged while the previous one is still queued on the device (a prefill chunk that samples nothing is not
    waited for; the engine overlaps decode steps)."""

    def __init__(self, i64_shape: tuple[int, ...], i32_size: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        i64_bytes = 8 * int(np.prod(i64_shape))
        self._host = torch.zeros(i64_bytes + 4 * i32_size, dtype=torch.uint8, pin_memory=pinned)
        self._dev = torch.zeros_like(self._host, device=device)
        self._i32_start = i64_bytes
        self.host_i64, self.host_i32 = self._views(self._host, i64_shape)
        self.dev_i64, self.dev_i32 = self._views(self._dev, i64_shape)
        self._copied = torch.cuda.Event() if pinned else None

    def _views(self, buffer: torch.Tensor, i64_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return (buffer[:self._i32_start].view(torch.int64).view(i64_shape),
                buffer[self._i32_start:].view(torch.int32))

    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """The host buffers to write, as arrays, once the previous step's copies are done."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.host_i64.numpy(), self.host_i32.numpy()

    def upload(self, i32_used: int | None = None) -> None:
        """Queue the copy of the host buffer to the device: the int64 values and the first ``i32_used`` int32 ones
        (default all; those past them keep what the device holds)."""
        end = self._host.numel() if i32_used is None else self._i32_start + 4 * i32_used
        self._dev[:end].copy_(self._host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class GraphSet(Generic[Key]):
    """One CUDA graph per key of a static-buffer ``forward``, in one memory pool, each captured when it is first
    needed rather than all at load: by ``run`` on the first step that takes its key (the step runs eagerly, which
    compiles and warms its kernels, and the graph is captured for the steps after it), or by ``capture_next`` while
    the engine is idle (the largest key first: the biggest buffers, which the smaller keys' captures then reuse).

    ``stage_padding(key)`` fills the static buffers with a step that reads and writes no KV block, for the warm-up of
    an idle capture. Captures use thread-local capture mode, so a thread of the embedding process that uses CUDA
    meanwhile is not disturbed."""

    def __init__(self, device: torch.device, keys: tuple[Key, ...], forward: Callable[[Key], torch.Tensor],
                 stage_padding: Callable[[Key], None]) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self._forward, self._stage_padding = forward, stage_padding
        self.pending: list[Key] = sorted(keys)  # the largest last: captured first when idle
        self.graphs: dict[Key, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Key, torch.Tensor] = {}
        self.capture_s = 0.0  # host time spent capturing, warm-ups included
        self._pool = torch.cuda.graph_pool_handle()

    def run(self, key: Key) -> torch.Tensor:
        """The output of ``forward(key)`` on the step in the static buffers: the graph's replay once captured, else
        an eager run, after which the graph is captured."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return self.outputs[key]
        output = self._forward(key)
        self._capture(key, time.perf_counter())
        return output

    @torch.inference_mode()
    def capture_next(self) -> bool:
        """Capture the largest pending key over padding (after an eager warm-up); False when none is pending. Only
        between steps: the static buffers are overwritten."""
        if not self.pending:
            return False
        start, key = time.perf_counter(), self.pending[-1]
        self._stage_padding(key)
        self._forward(key)
        self._capture(key, start)
        return True

    def capture_all(self) -> None:
        """Capture every pending key now, largest first (a load with ``cuda_graph_capture="at_load"``)."""
        while self.pending:
            self.capture_next()

    @torch.inference_mode()
    def _capture(self, key: Key, start: float) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.outputs[key] = self._forward(key)
        self.graphs[key] = graph
        self.pending.remove(key)
        self.capture_s += time.perf_counter() - start
