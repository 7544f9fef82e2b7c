"""Decode CUDA graphs: one graph per batch-size bucket, replayed with padded static buffers, each captured when first
needed (``cuda_graphs.GraphSet``).

A pure-decode step (every sequence brings one token) of ``n`` sequences runs in the smallest bucket ``bs >= n``: the
real rows are copied into static buffers, rows ``n..bs`` are padding (token 0 at position 0, KV slot -1 so the Triton
``store_kv`` writes nothing, context length 1 read from block 0), the bucket's graph replays, and the first ``n`` rows
of its logits are returned. Every bucket's metadata carries the plan's ``max_seq_len`` as its bound, so the split-KV
decode grid is the same at every replay; programs past a sequence's length return at once.

Graphs need the Triton kernels (the reference attention reads lengths on the host): they are captured on CUDA as
``RuntimeOptions.captures_cuda_graphs`` says. ``capture=False`` runs the same padded forward eagerly (how the CPU tests
check the padding).
"""

from __future__ import annotations

import torch

from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.cuda_graphs import GraphSet, StepStaging, doubling_sizes, smallest_bucket
from kiln.runtime.native.engine_format import EngineConfig
from kiln.runtime.native.kv_cache import KVCache
from kiln.runtime.native.model.decoder import DecoderModel

# Up to this many sequences the buckets double; above it they step by a quarter of the power of two below them, so
# that a batch pads by less than a quarter: from 128 rows the GEMMs are bound by compute, and every padding row costs
# its share. On an H200 (Llama-3-8B FP8, FP8 KV, 1,024-token contexts; tools/bench_step.py --graph-batch), a step
# padded to the next power of two against one in a bucket of its own size: 160 sequences 7.8 against 6.8 ms, 320
# 14.3 against 11.8, 384 15.5 against 14.0, 640 26.9 against 22.3.
QUARTER_STEPS_FROM = 128
# A bucket of 448 decoded slower than the 512 bucket, there: 448 sequences of 1k tokens 17.6 against 16.7 ms, 445 of
# 3k 30.9 against 30.0. 385-448 sequences run in the 512 bucket.
SLOWER_THAN_NEXT = frozenset({448})


def decode_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The buckets 1, 2, 4, ... 128, then 160, 192, 224, 256, 320, 384, 512, 640, ... (steps of a quarter of the
    power of two below) under ``max_batch_size``, then ``max_batch_size``."""
    sizes = list(doubling_sizes(1, min(max_batch_size, QUARTER_STEPS_FROM)))
    power = QUARTER_STEPS_FROM
    while power < max_batch_size:
        sizes += [size for size in range(power + power // 4, 2 * power + 1, power // 4)
                  if size < max_batch_size and size not in SLOWER_THAN_NEXT]
        power *= 2
    return (*sizes, max_batch_size) if sizes[-1] != max_batch_size else tuple(sizes)


class DecodeGraphRunner:
    """Static decode buffers for up to ``max(batch_sizes)`` sequences and, with ``capture``, one CUDA graph per bucket
    (captured when first needed: ``graphs``)."""

    def __init__(self, model: DecoderModel, kv_caches: list[KVCache], config: EngineConfig, device: torch.device,
                 batch_sizes: tuple[int, ...] | None = None, capture: bool = True) -> None:
        plan = config.plan
        self.model, self.kv_caches, self.device = model, kv_caches, torch.device(device)
        self.batch_sizes = tuple(sorted(set(batch_sizes or decode_batch_sizes(plan.max_batch_size))))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise ValueError(f"decode graph batch sizes must be positive, got {self.batch_sizes}")
        self.max_batch_size = max_bs = self.batch_sizes[-1]
        self.block_size = plan.tokens_per_block
        blocks_per_seq = -(-plan.max_seq_len // self.block_size)
        # int64 rows (token ids, positions, KV slots) and int32 (context lengths, then the block tables)
        self.staging = StepStaging((3, max_bs), max_bs * (1 + blocks_per_seq), self.device)
        self.input_ids, self.positions, self.slot_mapping = self.staging.dev_i64
        self.seq_lens = self.staging.dev_i32[:max_bs]
        self.block_tables = self.staging.dev_i32[max_bs:].view(max_bs, blocks_per_seq)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=self.device)
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        # the split-KV decode's partition counts (AttentionMetadata.partition_counters), zero between launches
        partition_counters = torch.zeros(max_bs * config.architecture.num_kv_heads, dtype=torch.int32,
                                         device=self.device)
        self._row_tables: list[tuple[list[int] | None, int]] = [(None, 0)] * max_bs  # (list, entries) each row holds
        self.metas = {
            bs: AttentionMetadata(slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
                                  seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
                                  max_query_len=1, max_seq_len=plan.max_seq_len,
                                  partition_counters=partition_counters)
            for bs in self.batch_sizes
        }
        self.graphs = GraphSet(self.device, self.batch_sizes, self._forward, self._stage_padding) if capture else None

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds ``n`` sequences."""
        return smallest_bucket(self.batch_sizes, n, "sequences", "decode")

    def fits(self, query_lens: list[int]) -> bool:
        """Whether a step with these query lengths is a pure decode that a bucket holds."""
        return 0 < len(query_lens) <= self.max_batch_size and all(q == 1 for q in query_lens)

    def run(self, token_ids: list[int], positions: list[int], seq_lens: list[int], block_tables: list[list[int]],
            fed_ids: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [n, vocab] (model dtype) of a decode step of n sequences (token ``token_ids[i]`` at ``positions[i]``,
        context ``seq_lens[i]`` tokens including it); K/V stored as usual. ``fed_ids`` (rows, tokens; on the device)
        replace those rows' ``token_ids``: tokens a step still running on the device samples.

        On the graph path the result is a view of the bucket's output buffer, valid until the next ``run``.
        """
        n = len(token_ids)
        bs = self.bucket(n)
        self._stage(token_ids, positions, seq_lens, block_tables, bs)
        if fed_ids is not None:
            self.input_ids.index_copy_(0, *fed_ids)  # after the staged copy, in stream order
        return (self.graphs.run(bs) if self.graphs is not None else self._forward(bs))[:n]

    def _stage(self, token_ids: list[int], positions: list[int], seq_lens: list[int], block_tables: list[list[int]],
               bs: int) -> None:
        """Write the step into the host buffers (rows n..bs are padding: token 0 at position 0, KV slot -1 so
        nothing is stored, context 1 read from block 0) and copy them to the static device buffers, the block
        tables up to the bucket's rows.

        A block table row is rewritten only where it changed: a sequence's table list only grows between steps
        (the block manager extends it, or gives the sequence a new list), so a row that held the same list keeps
        the entries it has. Entries past a table's end may be stale; attention never reads past a context."""
        n = len(token_ids)
        max_bs, block = self.max_batch_size, self.block_size
        i64, i32 = self.staging.host()
        tables = i32[max_bs:].reshape(max_bs, -1)
        i64[0, :n], i64[1, :n] = token_ids, positions
        i64[2, :n] = [table[pos // block] * block + pos % block for pos, table in zip(positions, block_tables,
                                                                                     strict=True)]
        i64[:, n:bs] = ((0,), (0,), (-1,))
        i32[:n], i32[n:bs] = seq_lens, 1
        row_tables = self._row_tables
        for i, table in enumerate(block_tables):  # seq_len <= max_seq_len: every table fits its row
            held, written = row_tables[i]
            start = written if held is table else 0
            if start < len(table):
                tables[i, start:len(table)] = table[start:]
                row_tables[i] = (table, len(table))
        tables[n:bs, 0] = 0
        row_tables[n:bs] = [(None, 0)] * (bs - n)
        self.staging.upload(max_bs + bs * tables.shape[1])  # the context lengths and the bucket's table rows

    def _stage_padding(self, bs: int) -> None:
        """A step of ``bs`` padding rows, which stores no K/V and reads block 0 only."""
        self._stage([], [], [], [], bs)

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.metas[bs], self.kv_caches)
        return self.model.compute_logits(hidden)


def maybe_decode_graphs(model: DecoderModel, kv_caches: list[KVCache], config: EngineConfig, device: torch.device,
                        enabled: bool) -> DecodeGraphRunner | None:
    """The decode graph runner on a CUDA device when ``enabled`` (its graphs not captured yet), else None."""
    if device.type != "cuda" or not enabled:
        return None
    return DecodeGraphRunner(model, kv_caches, config, device)
