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
from kiln.runtime.native.logprob_rows import token_logprobs
from kiln.runtime.sequence import Sequence

# Positions whose logits are materialised at once (each a float32 row of the vocabulary).
ROWS_PER_CHUNK = 256


@dataclass
class PromptLogprobs:
    """One sequence's entries from one step, on the device: those of prompt tokens ``first_token..``."""

    seq: Sequence
    first_token: int
    chosen: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None

    def append_to_sequence(self) -> None:
        """Add the entries the sequence does not have yet (all of them, unless this step recomputed its prompt)."""
        entries, first, count = self.seq.prompt_logprobs, self.first_token, len(self.chosen)
        width = self.seq.params.prompt_logprobs
        new = token_logprobs(self.seq.token_ids[first:first + count], self.chosen, self.top_values, self.top_ids,
                             [width] * count)
        entries.extend(new[len(entries) - first:] if len(entries) >= first else [])


def wants_prompt_logprobs(seq: Sequence, start: int) -> bool:
    """Whether a step that runs ``seq`` from position ``start`` yields prompt log probabilities for it."""
    return seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1


def prompt_logprobs(hidden: torch.Tensor, seq: Sequence, start: int, num_tokens: int,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> PromptLogprobs:
    """The entries of ``seq``'s prompt tokens that a step running positions ``start..start + num_tokens`` (whose
    hidden states are ``hidden`` [num_tokens, hidden]) predicts."""
    end = min(start + num_tokens, seq.num_prompt_tokens - 1)
    targets = device_tensor(seq.token_ids[start + 1:end + 1], torch.long, hidden.device)
    k = seq.params.prompt_logprobs
    chosen, values, ids = [], [], []
    for first in range(0, end - start, ROWS_PER_CHUNK):
        last = min(first + ROWS_PER_CHUNK, end - start)
        log_probs = compute_logits(hidden[first:last]).float().log_softmax(-1)
        chosen.append(log_probs.gather(-1, targets[first:last].unsqueeze(-1)).squeeze(-1))
        if k:
            top = log_probs.topk(k, dim=-1)
            values.append(top.values)
            ids.append(top.indices)
    return PromptLogprobs(seq, start + 1, torch.cat(chosen), torch.cat(values) if k else None,
                          torch.cat(ids) if k else None)
