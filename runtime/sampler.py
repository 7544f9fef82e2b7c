"""Next-token choice from logits: greedy, temperature, top-k, top-p, with a per-request random generator."""

from __future__ import annotations

import random

import torch

from runtime.errors import KilnError
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence


class SamplingError(KilnError):
    """One request's next token could not be sampled (non-finite probabilities, a seed torch refuses); only that
    request fails."""


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf the logits outside the `top_k` most likely tokens and outside the smallest set whose
    probability reaches `top_p` (`top_k` <= 0 and `top_p` == 1 disable each filter). `logits` is [vocab]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))
    return logits


def request_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    """A generator of the request's own: seeded ones give the same tokens whatever else shares the batch."""
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else random.SystemRandom().getrandbits(63))
    return generator


class Sampler:
    """Samples one token per row of `logits` (float32 [num_seqs, vocab]) for the matching sequence.

    A row that cannot be sampled gets a SamplingError in place of its token, so that only its request fails.
    """

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | SamplingError]:
        tokens = logits.argmax(dim=-1)
        failed: dict[int, SamplingError] = {}
        for row, seq in enumerate(seqs):
            params = seq.params
            if params.greedy:
                continue
            try:  # multinomial checks its input on the host (CPU and CUDA alike) and raises RuntimeError
                if seq.generator is None:
                    seq.generator = request_generator(params, logits.device)
                filtered = apply_top_k_top_p(logits[row] / params.temperature, params.top_k, params.top_p)
                tokens[row] = torch.multinomial(filtered.softmax(-1), 1, generator=seq.generator)[0]
            except (RuntimeError, ValueError) as e:
                failed[row] = SamplingError(f"request {seq.request_id}: no token could be sampled "
                                            f"({type(e).__name__}: {e})")
        sampled: list[int | SamplingError] = tokens.tolist()
        for row, error in failed.items():
            sampled[row] = error
        return sampled
