"""What one request may ask of a loaded engine: its build plan's bounds and the size of its KV pool."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLimits:
    """The bounds an engine was built for (`max_input_len`, `max_seq_len`, `max_batch_size`, `max_num_tokens`) and
    how many tokens its paged KV pool holds (`kv_pool_tokens`; None when the backend sizes the pool itself)."""

    max_input_len: int
    max_seq_len: int
    max_batch_size: int
    max_num_tokens: int
    kv_pool_tokens: int | None = None

    @classmethod
    def from_plan(cls, plan: Mapping[str, int], kv_pool_tokens: int | None = None) -> EngineLimits:
        """The limits of a build plan given as a mapping (engine.json's or kiln_trtllm.json's `plan`)."""
        return cls(max_input_len=plan["max_input_len"], max_seq_len=plan["max_seq_len"],
                   max_batch_size=plan["max_batch_size"], max_num_tokens=plan["max_num_tokens"],
                   kv_pool_tokens=kv_pool_tokens)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt plus generated) one request can hold: `max_seq_len`, or less if the KV pool is
        smaller."""
        return self.max_seq_len if self.kv_pool_tokens is None else min(self.max_seq_len, self.kv_pool_tokens)
