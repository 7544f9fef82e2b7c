"""Prompt log probabilities (``SamplingParams.prompt_logprobs``): each prompt token's log probability given the
tokens before it, and the most likely alternatives, computed from a prefill step's hidden states on the device.

A step runs positions ``start..start + n`` of a sequence; the logits at position ``p`` give the distribution of token
``p + 1``, so the step yields the entries of prompt tokens ``start + 1 ..`` up to the last prompt token (the last
position's logits choose the first completion token instead). Requests that ask skip the prefix cache
(``BlockManager.get_computed_blocks``) so that every prompt position runs through the model once; a recompute after
preemption yields entries the sequence already has, which are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.runtime.native.device_copy import device_tensor
from kiln.runtime.native.logprob_rows import chosen_logprobs, token_logprobs
from kiln.runtime.sequence import Sequence

# Positions whose logits are materialised at once (each a float32 row of the vocabulary).
ROWS_PER_CHUNK = 256


@dataclass
class PromptLogprobs:
    """One sequence's entries from one step, on the device: those of prompt tokens ``first_token..``."""

    seq: Sequence
    first_token: int
    chosen: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None

    def append_to_sequence(self) -> None:
        """Add the entries the sequence does not have yet (all of them, unless this step recomputed its prompt)."""
        entries, first, count = self.seq.prompt_logprobs, self.first_token, len(self.chosen)
        width = self.seq.params.prompt_logprobs
        new = token_logprobs(self.seq.token_ids[first:first + count], self.chosen, self.ranks, self.top_values,
                             self.top_ids, [width] * count)
        entries.extend(new[len(entries) - first:] if len(entries) >= first else [])


def wants_prompt_logprobs(seq: Sequence, start: int) -> bool:
    """Whether a step that runs ``seq`` from position ``start`` yields prompt log probabilities for it."""
    return seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1


def prompt_positions(seq: Sequence, start: int, num_tokens: int) -> int:
    """How many of the positions ``start..start + num_tokens`` a step runs predict a prompt token of ``seq``."""
    return min(start + num_tokens, seq.num_prompt_tokens - 1) - start


def logits_in_chunks(hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                     consume: Callable[[torch.Tensor], None]) -> None:
    """Hand ``consume`` the logits of every row of ``hidden``, ``ROWS_PER_CHUNK`` rows at a time (one chunk of
    vocabulary-wide rows in memory at once)."""
    for first in range(0, len(hidden), ROWS_PER_CHUNK):
        consume(compute_logits(hidden[first:first + ROWS_PER_CHUNK]))


class PromptLogprobsCollector:
    """Builds one sequence's ``PromptLogprobs`` from the logits of its positions ``start..``, chunk by chunk: the
    entries of prompt tokens ``start + 1..``."""

    def __init__(self, seq: Sequence, start: int, count: int) -> None:
        self.seq, self.start, self.count = seq, start, count
        self.k = seq.params.prompt_logprobs
        self.chosen: list[torch.Tensor] = []
        self.ranks: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []
        self.targets: torch.Tensor | None = None
        self.read = 0

    def add(self, logits: torch.Tensor) -> None:
        """The logits of the next positions."""
        if self.targets is None:
            self.targets = device_tensor(self.seq.token_ids[self.start + 1:self.start + 1 + self.count], torch.long,
                                         logits.device)
        log_probs = logits.float().log_softmax(-1)
        targets = self.targets[self.read:self.read + len(logits)]
        chosen, ranks = chosen_logprobs(log_probs, targets)
        self.chosen.append(chosen)
        self.ranks.append(ranks)
        self.read += len(logits)
        if self.k:
            top = log_probs.topk(self.k, dim=-1)
            self.values.append(top.values)
            self.ids.append(top.indices)

    def result(self) -> PromptLogprobs:
        values, ids = (torch.cat(self.values), torch.cat(self.ids)) if self.k else (None, None)
        return PromptLogprobs(self.seq, self.start + 1, torch.cat(self.chosen), torch.cat(self.ranks), values,
                              ids)
