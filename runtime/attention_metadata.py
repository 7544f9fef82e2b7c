"""Flat-batch attention metadata, passed explicitly from the model runner to every attention layer.

Token t of sequence i (0 <= t < q_len_i) sits at absolute position ``seq_lens[i] - q_len_i + t`` and attends to KV
positions 0..that position (causal). This one form covers prefill, chunked prefill, prefix-cache hits and decode.
A step of one whole prompt (no cached context) is marked, so that attention may run over its new K/V directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for sequences whose last ``query_lens[i]`` of ``seq_lens[i]`` tokens are new this step."""
        slots = []
        for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 0 < q_len <= seq_len or len(table) * block_size < seq_len:
                raise ValueError(f"inconsistent sequence: query_len {q_len}, seq_len {seq_len}, "
                                 f"{len(table)} blocks of {block_size}")
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len))
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        cu = [0]
        for q_len in query_lens:
            cu.append(cu[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decode_seqs=next((i for i, q_len in enumerate(query_lens) if q_len != 1), len(query_lens)),
            whole_prompt=len(query_lens) == 1 and query_lens[0] == seq_lens[0],
        )

    def leading_decodes(self) -> AttentionMetadata:
        """The metadata of the leading ``num_decode_seqs`` sequences alone (their query rows come first)."""
        n = self.num_decode_seqs
        return AttentionMetadata(self.slot_mapping[:n], self.query_start_loc[:n + 1], self.seq_lens[:n],
                                 self.block_tables[:n], max_query_len=1, max_seq_len=self.max_seq_len,
                                 num_decode_seqs=n)
