"""A request's state as the scheduler, block manager and model runner see it."""

from __future__ import annotations

import itertools
import time
from enum import Enum
from typing import TYPE_CHECKING

from kiln.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance
    import torch

    from kiln.runtime.outputs import TokenLogprob


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt then completion), how many of them have KV in the cache, and where that KV lives.

    `num_computed_tokens` counts tokens whose KV is written (by this sequence or found in the prefix cache);
    `num_cached_tokens` is the part of it that came from the prefix cache at the last admission. `seq_id` grows with
    arrival, so it orders sequences first come, first served.
    """

    _ids = itertools.count()

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that finished it
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.cache_salt = b""  # the seed of its block hashes: KV rotated differently never matches (set by the engine)
        # LongRoPE: the length at which its KV, rotated for a shorter sequence, is recomputed, and the salt after that
        self.recompute_at: int | None = None
        self.recompute_salt = b""
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        self.matcher: llguidance.LLMatcher | None = None  # of a request with structured output, set by the engine
        self.allowed_ids: torch.Tensor | None = None  # its allowed_token_ids on the device, made at first use
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None  # when the scheduler first admitted it
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.inter_token_latencies: list[float] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if params.prompt_logprobs is not None else None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(request_id={self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decode(self) -> bool:
        """True when the only token without KV is the last sampled one (one token per step from here on)."""
        return self.num_completion_tokens > 0 and self.num_computed_tokens == self.num_tokens - 1

    def recompute_due(self, more_tokens: int = 0) -> bool:
        """True when the sequence, ``more_tokens`` longer, has grown to ``recompute_at``: its KV must be computed
        anew (``restart_kv``)."""
        return self.recompute_at is not None and self.num_tokens + more_tokens >= self.recompute_at

    def restart_kv(self) -> None:
        """Forget the sequence's block hashes and take the salt of the KV it is recomputed with (its blocks are freed
        by the scheduler)."""
        self.cache_salt, self.block_hashes, self.recompute_at = self.recompute_salt, [], None

    def append_token(self, token_id: int, now: float | None = None, logprob: TokenLogprob | None = None) -> None:
        """Add a sampled token (with its log probabilities, when the request asked for them) and record its
        latency."""
        now = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)

    def finish(self, reason: str, now: float | None = None) -> None:
        """Mark the sequence finished ("stop", "length", "abort", or "error": it failed)."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finished_time = time.monotonic() if now is None else now
