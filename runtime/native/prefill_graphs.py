"""Prefill CUDA graphs: one graph per token-count bucket for steps of a single sequence, each captured when first
needed (``cuda_graphs.GraphSet``).

An eager prefill launches about thirty kernels per layer from Python, which on an idle engine takes longer than the
GPU needs to run them: a 1000-token FP8 prefill of Llama-3-8B is 16 ms of GPU work and ~24 ms of launching. A step
of one sequence bringing ``n`` tokens (a prompt, a chunk of one, or the rest of a prompt after a prefix-cache hit)
runs in the smallest bucket ``T >= n``: tokens ``n..T`` are padding (token 0 at position 0, KV slot -1 so nothing is
stored, outside the sequence since ``query_start_loc = [0, n]``), so attention never reads or writes them and every
other op is row-wise. The graph returns the logits of token ``n - 1``. Each bucket's metadata carries ``T`` as its
query-length bound and the plan's ``max_seq_len``, so the attention grid is fixed; programs past ``n`` return at once.
Each bucket has two graphs: one for a whole prompt, whose attention runs causally over the bucket's new K/V directly
(``AttentionMetadata.whole_prompt``; the padding rows come last, so no prompt row sees them), and one for a step that
continues a cached context.

Captured as the decode graphs are (``RuntimeOptions.captures_cuda_graphs``); ``capture=False`` runs the same padded
forward eagerly (how the CPU tests check the padding).
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.cuda_graphs import GraphSet, StepStaging, doubling_sizes, smallest_bucket
from kiln.runtime.native.engine_format import EngineConfig
from kiln.runtime.native.kv_cache import KVCache
from kiln.runtime.native.model.decoder import DecoderModel

# Buckets double from MIN to MAX tokens (capped by the plan's max_num_tokens): above MAX a prefill's GPU work
# outweighs its launches, and each bucket costs a capture.
PREFILL_GRAPH_MIN_TOKENS, PREFILL_GRAPH_MAX_TOKENS = 64, 2048


def prefill_token_buckets(max_num_tokens: int) -> tuple[int, ...]:
    """64, 128, ... up to PREFILL_GRAPH_MAX_TOKENS, or up to ``max_num_tokens`` (then it as the last bucket)."""
    return doubling_sizes(PREFILL_GRAPH_MIN_TOKENS, min(max_num_tokens, PREFILL_GRAPH_MAX_TOKENS))


class PrefillGraphRunner:
    """Static buffers for one sequence of up to ``max(token_buckets)`` new tokens and, with ``capture``, one CUDA graph
    per bucket and kind (captured when first needed: ``graphs``)."""

    def __init__(self, model: DecoderModel, kv_caches: list[KVCache], config: EngineConfig, device: torch.device,
                 token_buckets: tuple[int, ...] | None = None, capture: bool = True) -> None:
        plan = config.plan
        self.model, self.kv_caches, self.device = model, kv_caches, torch.device(device)
        self.token_buckets = tuple(sorted(set(token_buckets or prefill_token_buckets(plan.max_num_tokens))))
        if not self.token_buckets or self.token_buckets[0] < 2:
            raise ValueError(f"prefill graph buckets must hold at least 2 tokens, got {self.token_buckets}")
        self.max_tokens = max_t = self.token_buckets[-1]
        self.block_size = plan.tokens_per_block
        blocks_per_seq = -(-plan.max_seq_len // self.block_size)
        # int64 (token ids, positions, KV slots, index of the last token) and int32 (query_start_loc, the context
        # length, the block table)
        self.staging = StepStaging((3 * max_t + 1,), 3 + blocks_per_seq, self.device)
        dev_i64, dev_i32 = self.staging.dev_i64, self.staging.dev_i32
        self.input_ids, self.positions, self.slot_mapping = dev_i64[:3 * max_t].view(3, max_t)
        self.last_index = dev_i64[3 * max_t:]
        self.slot_mapping.fill_(-1)
        self.metas = {
            (t, whole): AttentionMetadata(slot_mapping=self.slot_mapping[:t], query_start_loc=dev_i32[:2],
                                          seq_lens=dev_i32[2:3], block_tables=dev_i32[3:].view(1, blocks_per_seq),
                                          max_query_len=t, max_seq_len=plan.max_seq_len, whole_prompt=whole)
            for t in self.token_buckets for whole in (False, True)
        }
        self.graphs = GraphSet(self.device, tuple(self.metas), self._forward, self._stage_padding) if capture \
            else None

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds ``n`` tokens."""
        return smallest_bucket(self.token_buckets, n, "tokens", "prefill")

    def fits(self, query_lens: list[int]) -> bool:
        """Whether a step with these query lengths is one sequence of 2..max_tokens new tokens."""
        return len(query_lens) == 1 and 1 < query_lens[0] <= self.max_tokens

    def run(self, token_ids: list[int], positions: list[int], seq_len: int, block_table: list[int]) -> torch.Tensor:
        """Logits [1, vocab] (model dtype) of the last of ``token_ids`` (at ``positions``, the sequence's last
        ``len(token_ids)`` of ``seq_len`` tokens); K/V stored as usual. On the graph path the result is a view of the
        bucket's output buffer, valid until the next ``run``."""
        n = len(token_ids)
        key = self.bucket(n), n == seq_len
        self._stage(token_ids, positions, seq_len, block_table, key[0])
        return self.graphs.run(key) if self.graphs is not None else self._forward(key)

    def _stage(self, token_ids: list[int], positions: list[int], seq_len: int, block_table: list[int],
               t: int) -> None:
        n, max_t, block = len(token_ids), self.max_tokens, self.block_size
        i64, i32 = self.staging.host()
        ids, pos, slots = i64[:3 * max_t].reshape(3, max_t)
        table = np.asarray(block_table, dtype=np.int64)
        pos[:n] = positions
        ids[:n] = token_ids
        slots[:n] = table[pos[:n] // block] * block + pos[:n] % block
        ids[n:t], pos[n:t], slots[n:t] = 0, 0, -1
        i64[3 * max_t] = n - 1
        i32[:3] = 0, n, seq_len
        i32[3:] = 0
        i32[3:3 + len(block_table)] = block_table[:len(i32) - 3]  # seq_len <= max_seq_len: the table fits
        self.staging.upload()

    def _stage_padding(self, key: tuple[int, bool]) -> None:
        """An empty sequence: every token padding (stores no K/V), no context, the logits of row 0."""
        i64, i32 = self.staging.host()
        i64[:] = 0
        i64[2 * self.max_tokens:3 * self.max_tokens] = -1
        i32[:] = 0
        self.staging.upload()

    def _forward(self, key: tuple[int, bool]) -> torch.Tensor:
        """The padded forward of bucket ``key[0]`` tokens, for a whole prompt when ``key[1]``."""
        t = key[0]
        hidden = self.model(self.input_ids[:t], self.positions[:t], self.metas[key], self.kv_caches)
        return self.model.compute_logits(hidden.index_select(0, self.last_index))


def maybe_prefill_graphs(model: DecoderModel, kv_caches: list[KVCache], config: EngineConfig, device: torch.device,
                         enabled: bool) -> PrefillGraphRunner | None:
    """The prefill graph runner on a CUDA device when ``enabled`` (its graphs not captured yet), else None."""
    if device.type != "cuda" or not enabled or config.plan.max_num_tokens < 2:
        return None
    return PrefillGraphRunner(model, kv_caches, config, device)
