"""Next-token choice from logits: greedy, temperature, top-k, top-p, with a per-request random generator."""

from __future__ import annotations

import random

import torch

from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence


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
    """Samples one token per row of `logits` (float32 [num_seqs, vocab]) for the matching sequence."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        tokens = logits.argmax(dim=-1)
        for row, seq in enumerate(seqs):
            params = seq.params
            if params.greedy:
                continue
            if seq.generator is None:
                seq.generator = request_generator(params, logits.device)
            filtered = apply_top_k_top_p(logits[row] / params.temperature, params.top_k, params.top_p)
            tokens[row] = torch.multinomial(filtered.softmax(-1), 1, generator=seq.generator)[0]
        return tokens.tolist()
