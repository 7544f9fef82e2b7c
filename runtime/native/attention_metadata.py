"""Flat-batch attention metadata, passed explicitly from the model runner to every attention layer.

Token t of sequence i (0 <= t < q_len_i) sits at absolute position ``seq_lens[i] - q_len_i + t`` and attends to KV
positions 0..that position (causal). This one form covers prefill, chunked prefill, prefix-cache hits and decode.
A step of one whole prompt (no cached context) is marked, so that attention may run over its new K/V directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.runtime.native.device_copy import device_tensor


@dataclass
class AttentionMetadata:
    """vLLM-style metadata of one flat batch of new tokens."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: flat KV slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cu_seqlens of the new tokens in the flat batch
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length including the new tokens
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    max_query_len: int
    max_seq_len: int
    num_decode_seqs: int = 0  # leading sequences of one new token each (a mixed step lists its decodes first)
    whole_prompt: bool = False  # one sequence, all new: query row i is position i (padding rows may follow)
    # int32 zeros, one per sequence and KV head or more, kept across steps (a decode graph's): the split-KV decode
    # counts finished partitions in them and leaves them zero (kernels.paged_attention.combine_partitions)
    partition_counters: torch.Tensor | None = None

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for sequences whose last ``query_lens[i]`` of ``seq_lens[i]`` tokens are new this step.

        Array arithmetic, not a loop over tokens: a mixed step of ~8k new tokens is built in well under a
        millisecond, while the device waits for it."""
        if not len(query_lens) == len(seq_lens) == len(block_tables):
            raise ValueError(f"{len(query_lens)} query lengths, {len(seq_lens)} sequence lengths and "
                             f"{len(block_tables)} block tables: one of each per sequence")
        q_lens, lens = np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
        num_blocks = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
        bad = np.flatnonzero((q_lens <= 0) | (q_lens > lens) | (num_blocks * block_size < lens))
        if bad.size:
            i = bad[0]
            raise ValueError(f"inconsistent sequence: query_len {q_lens[i]}, seq_len {lens[i]}, "
                             f"{num_blocks[i]} blocks of {block_size}")
        width = int(num_blocks.max())
        tables = np.array([t + [0] * (width - len(t)) for t in block_tables], dtype=np.int64)
        cu = np.concatenate(([0], np.cumsum(q_lens)))
        seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
        positions = np.arange(cu[-1]) - (cu[:-1] - (lens - q_lens))[seq_of_token]  # sequence i's from len - q_len
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        return cls(
            slot_mapping=device_tensor(slots, torch.int64, device),
            query_start_loc=device_tensor(cu, torch.int32, device),
            seq_lens=device_tensor(lens, torch.int32, device),
            block_tables=device_tensor(tables, torch.int32, device),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(lens.max()),
            num_decode_seqs=next((i for i, q_len in enumerate(query_lens) if q_len != 1), len(query_lens)),
            whole_prompt=len(query_lens) == 1 and query_lens[0] == seq_lens[0],
        )

    def leading_decodes(self) -> AttentionMetadata:
        """The metadata of the leading ``num_decode_seqs`` sequences alone (their query rows come first)."""
        n = self.num_decode_seqs
        return AttentionMetadata(self.slot_mapping[:n], self.query_start_loc[:n + 1], self.seq_lens[:n],
                                 self.block_tables[:n], max_query_len=1, max_seq_len=self.max_seq_len,
                                 num_decode_seqs=n)
