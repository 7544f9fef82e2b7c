"""Decode CUDA graphs: one graph per batch-size bucket, captured at load, replayed with padded static buffers.

A pure-decode step (every sequence brings one token) of ``n`` sequences runs in the smallest bucket ``bs >= n``: the
real rows are copied into static buffers, rows ``n..bs`` are padding (token 0 at position 0, KV slot -1 so the Triton
``store_kv`` writes nothing, context length 1 read from block 0), the bucket's graph replays, and the first ``n`` rows
of its logits are returned. Every bucket's metadata carries the plan's ``max_seq_len`` as its bound, so the split-KV
decode grid is the same at every replay; programs past a sequence's length return at once.

Graphs need the Triton attention kernels (the reference attention reads lengths on the host), so capture is opt-in:
``KILN_CUDA_GRAPHS=1`` together with ``KILN_ATTENTION_BACKEND=triton``, on CUDA. ``capture=False`` runs the same
padded forward eagerly (how the CPU tests check the padding).
"""

from __future__ import annotations

import logging
import os

import torch

from runtime.attention_metadata import AttentionMetadata
from runtime.engine_format import EngineConfig
from runtime.errors import KilnError
from runtime.kv_cache import KVCache
from runtime.model.llama import LlamaModel

logger = logging.getLogger("kiln.runtime")


class CudaGraphsConfigError(KilnError):
    """KILN_CUDA_GRAPHS is set to something that cannot run."""


def decode_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The buckets 1, 2, 4, ... below ``max_batch_size``, then ``max_batch_size`` itself."""
    sizes, bs = [], 1
    while bs < max_batch_size:
        sizes.append(bs)
        bs *= 2
    return (*sizes, max_batch_size)


def cuda_graphs_requested() -> bool:
    """Whether ``KILN_CUDA_GRAPHS=1``; refuses a value other than 0/1 and graphs without the Triton attention."""
    value = os.environ.get("KILN_CUDA_GRAPHS", "0")
    if value not in ("0", "1"):
        raise CudaGraphsConfigError(f"KILN_CUDA_GRAPHS={value!r} must be 0 or 1; unset it for eager decode")
    if value == "0":
        return False
    from runtime.layers import attention  # read at call time: the backend is chosen when that module is imported

    if attention.ATTENTION_BACKEND != "triton":
        raise CudaGraphsConfigError(
            f"KILN_CUDA_GRAPHS=1 needs KILN_ATTENTION_BACKEND=triton (it is {attention.ATTENTION_BACKEND!r}; the "
            "reference attention reads lengths on the host and cannot be captured): set "
            "KILN_ATTENTION_BACKEND=triton, or unset KILN_CUDA_GRAPHS")
    return True


class DecodeGraphRunner:
    """Static decode buffers for up to ``max(batch_sizes)`` sequences and one CUDA graph per bucket."""

    def __init__(self, model: LlamaModel, kv_caches: list[KVCache], config: EngineConfig, device: torch.device,
                 batch_sizes: tuple[int, ...] | None = None, capture: bool = True) -> None:
        plan = config.plan
        self.model, self.kv_caches, self.device = model, kv_caches, torch.device(device)
        self.batch_sizes = tuple(sorted(set(batch_sizes or decode_batch_sizes(plan.max_batch_size))))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise ValueError(f"decode graph batch sizes must be positive, got {self.batch_sizes}")
        self.max_batch_size = max_bs = self.batch_sizes[-1]
        blocks_per_seq = -(-plan.max_seq_len // plan.tokens_per_block)
        with torch.device(self.device):
            self.input_ids = torch.zeros(max_bs, dtype=torch.long)
            self.positions = torch.zeros(max_bs, dtype=torch.long)
            self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64)
            self.seq_lens = torch.ones(max_bs, dtype=torch.int32)
            self.block_tables = torch.zeros(max_bs, blocks_per_seq, dtype=torch.int32)
            self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32)
        self.metas = {
            bs: AttentionMetadata(slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
                                  seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
                                  max_query_len=1, max_seq_len=plan.max_seq_len)
            for bs in self.batch_sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds ``n`` sequences."""
        for bs in self.batch_sizes:
            if bs >= n:
                return bs
        raise ValueError(f"{n} sequences exceed the largest decode graph bucket ({self.max_batch_size})")

    def fits(self, query_lens: list[int]) -> bool:
        """Whether a step with these query lengths is a pure decode that a bucket holds."""
        return 0 < len(query_lens) <= self.max_batch_size and all(q == 1 for q in query_lens)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Float32 logits [n, vocab] of a decode step of n sequences (one token each); K/V stored as usual.

        On the graph path the result is a view of the bucket's output buffer, valid until the next ``run``.
        """
        n = input_ids.shape[0]
        bs = self.bucket(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = min(meta.block_tables.shape[1], self.block_tables.shape[1])  # seq_len <= max_seq_len: enough
        self.block_tables[:bs].zero_()
        self.block_tables[:n, :width].copy_(meta.block_tables[:, :width])
        if n < bs:  # padding rows: store nothing, attend to one token of block 0
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.logits[bs][:n]
        return self._forward(bs)[:n]

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.metas[bs], self.kv_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Warm every bucket up eagerly (compiling the kernels), then capture, largest first, into one pool.

        The static buffers hold padding only, so neither the warm-up nor the capture writes the KV cache.
        """
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in self.batch_sizes:
                self._forward(bs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)


def maybe_capture_decode_graphs(model: LlamaModel, kv_caches: list[KVCache], config: EngineConfig,
                                device: torch.device) -> DecodeGraphRunner | None:
    """The captured decode graphs when ``KILN_CUDA_GRAPHS=1`` on a CUDA device, else None (eager decode)."""
    if not cuda_graphs_requested():
        return None
    if device.type != "cuda":
        logger.info("KILN_CUDA_GRAPHS=1 ignored on %s: decode runs eagerly", device)
        return None
    runner = DecodeGraphRunner(model, kv_caches, config, device)
    logger.info("captured decode CUDA graphs for batch sizes %s", ", ".join(map(str, runner.batch_sizes)))
    return runner
