"""Next-token choice from logits: the requests' logit controls, then greedy, temperature, top-k, top-p, with a
per-request random generator; and the log probabilities of the chosen tokens for the requests that ask.

Every sampled row of a step is drawn at once: temperature and the top-k / top-p filters run on the batch, and the
draw is an exponential race (``argmax(p / q)`` with ``q ~ Exp(1)`` per token picks token i with probability p_i),
so a step costs a few kernels and one copy to the host whatever its size (drawing row by row took ~1,800 operations
for a batch of 256, and on a GPU a host synchronisation per row). A seeded request draws its ``q`` from its own
generator, so its tokens do not depend on what else shares the batch; unseeded rows share one generator.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from kiln.runtime.errors import NoTokenAllowedError, SamplingError
from kiln.runtime.native.device_copy import device_tensor
from kiln.runtime.native.grammar import Grammars, apply_token_bitmask
from kiln.runtime.native.kernel_choice import DEFAULT_KERNELS, KernelChoice
from kiln.runtime.native.logit_controls import UnseenTokens, apply_logit_controls
from kiln.runtime.native.logprob_rows import chosen_logprobs, token_logprobs
from kiln.runtime.outputs import TokenLogprob
from kiln.runtime.sequence import Sequence


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf, in each row i of ``logits`` [n, vocab], the logits outside its ``top_k[i]`` most likely tokens
    (ties kept) and then outside the smallest set whose probability reaches ``top_p[i]``. A ``top_k`` <= 0 or >=
    vocab and a ``top_p`` of 1 disable each filter for that row; the most likely token always stays. Top-k alone
    takes ``torch.topk``; top-p sorts."""
    vocab, device = logits.shape[-1], logits.device
    k = [kk if 0 < kk < vocab else 0 for kk in top_k]
    kept = device_tensor(k, torch.long, device).unsqueeze(-1)  # 0: no top-k for the row
    if any(p < 1.0 for p in top_p):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # ties: the same order alone
        kth = sorted_logits.gather(-1, (kept - 1).clamp_(min=0))
    else:
        kth = torch.topk(logits, max(k), dim=-1).values.gather(-1, (kept - 1).clamp_(min=0))
    kth = kth.masked_fill(kept == 0, float("-inf"))
    logits = logits.masked_fill(logits < kth, float("-inf"))
    if all(p >= 1.0 for p in top_p):
        return logits
    probs = sorted_logits.masked_fill(sorted_logits < kth, float("-inf")).softmax(-1)
    limit = device_tensor(top_p, probs.dtype, device).unsqueeze(-1)
    drop = (probs.cumsum(-1) - probs >= limit) & (limit < 1.0)
    drop[:, 0] = False  # the most likely token stays, however small top_p (a float32 limit of 1e-46 is 0)
    return logits.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Set to -inf, in each row i of ``logits`` [n, vocab], the logits of tokens less likely than ``min_p[i]`` times
    the row's most likely one (vLLM's min-p; 0 disables it): ``p / p_max >= min_p`` is ``logit >= max + log min_p``,
    so no softmax is needed."""
    floor = device_tensor([math.log(p) if p > 0 else float("-inf") for p in min_p], logits.dtype, logits.device)
    return logits.masked_fill(logits < logits.amax(-1, keepdim=True) + floor.unsqueeze(-1), float("-inf"))


def _log_softmax(logits: torch.Tensor, rows: list[int], constrained: list[int],
                 bitmask: np.ndarray | None) -> torch.Tensor | None:
    """float32 log-probabilities [len(rows), vocab] of the model's logits in ``rows`` (None for no rows), over the
    tokens a ``constrained`` row's structured output allows (its row of ``bitmask``), as vLLM's raw logprobs."""
    if not rows:
        return None
    x = logits[device_tensor(rows, torch.long, logits.device)].float()
    position = {row: p for p, row in enumerate(rows)}
    masked = [(position[row], k) for k, row in enumerate(constrained) if row in position]
    if masked:
        apply_token_bitmask(x, [p for p, _ in masked], bitmask[[k for _, k in masked]])
    return x.log_softmax(-1)


def request_generator(seed: int, device: torch.device) -> torch.Generator:
    """A seeded request's own generator: its tokens do not depend on what else shares the batch. A CPU generator
    (mt19937) keeps only the low 32 bits of its seed, so there a seed of 2**32 or more is first mixed down to 32
    bits (splitmix64's finaliser): seeds that differ anywhere, neighbours such as 2**63 - 1 and 2**63 or 2**64 - 1
    (OpenAI's -1) and 0 included, then draw differently; seeds below 2**32 are used as they are."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if generator.device.type != "cpu" or seed < 2**32 else _mixed_to_32_bits(seed))
    return generator


def _mixed_to_32_bits(seed: int) -> int:
    """splitmix64's output function of a 64-bit ``seed``, its low 32 bits: a bijection's well-mixed bits, so that
    structured seeds do not collide the way a fold of the high half into the low one does."""
    mask = 2**64 - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & 0xFFFFFFFF


@dataclass
class DrawnLogprobs:
    """On the device, for the ``rows`` whose requests asked: the chosen token's log probability and the ``top``
    most likely tokens' (as many as the most any of them asked for; None when that is 0)."""

    rows: list[int]
    chosen: torch.Tensor
    ranks: torch.Tensor
    top: torch.return_types.topk | None

    def on_host(self, tokens: list[int], seqs: list[Sequence]) -> dict[int, TokenLogprob]:
        """Each row's TokenLogprob (rows whose token failed have none), cut to what its request asked for."""
        top_values, top_ids = (self.top.values, self.top.indices) if self.top is not None else (None, None)
        entries = token_logprobs([tokens[row] for row in self.rows], self.chosen, self.ranks, top_values, top_ids,
                                 [seqs[row].params.logprobs for row in self.rows])
        return {row: entry for row, entry in zip(self.rows, entries, strict=True) if tokens[row] >= 0}


@dataclass
class Draw:
    """One token per row, still on the device (``NOT_FINITE`` where a row had a NaN or +inf logit, ``NONE_ALLOWED``
    where its controls masked every token), the rows that failed before drawing, and the log probabilities the rows'
    requests asked for."""

    tokens: torch.Tensor
    seqs: list[Sequence]
    failed: dict[int, SamplingError]
    logprobs: DrawnLogprobs | None = None

    def resolve(self, tokens: list[int]) -> list[int | SamplingError]:
        """The rows' tokens (``tokens``: ``self.tokens`` on the host) with each failed row's SamplingError."""
        sampled: list[int | SamplingError] = list(tokens)
        for row, seq in enumerate(self.seqs):
            if row in self.failed:
                sampled[row] = self.failed[row]
            elif tokens[row] == NONE_ALLOWED:  # the request's own constraints: the client's to fix
                sampled[row] = NoTokenAllowedError(
                    f"request {seq.request_id}: no token could be sampled: no token is allowed (allowed_token_ids, "
                    f"min_tokens' hold on the stop tokens and the structured output together exclude every one)")
            elif tokens[row] < 0:
                sampled[row] = sampling_error(seq, ValueError("non-finite logits"))
        return sampled


NOT_FINITE, NONE_ALLOWED = -1, -2  # a row's token where none could be drawn: a NaN or +inf logit, or none unmasked


def _drawable(best: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` where the row's ``best`` logit is finite, else why not (NOT_FINITE, or NONE_ALLOWED for -inf)."""
    why = torch.where(best == float("-inf"), NONE_ALLOWED, NOT_FINITE)
    return torch.where(best.isfinite(), tokens, why)


def sampling_error(seq: Sequence, e: Exception) -> SamplingError:
    """The error that fails ``seq``'s request alone."""
    return SamplingError(f"request {seq.request_id}: no token could be sampled ({type(e).__name__}: {e})")


class Sampler:
    """Samples one token per row of `logits` ([num_seqs, vocab], any float dtype) for the matching sequence: the
    argmax for greedy rows, else a draw in float32, after the request's logit controls (``stop_token_ids``: the
    engine's EOS, which ``min_tokens`` holds back) and its structured output's token mask (``grammars``).

    A row that cannot be sampled gets a SamplingError in place of its token, so that only its request fails. On CUDA
    the argmaxes run the Triton kernel of ``kernels.argmax`` unless ``kernels`` says otherwise.
    """

    def __init__(self, stop_token_ids: Collection[int] = (), grammars: Grammars | None = None,
                 kernels: KernelChoice = DEFAULT_KERNELS) -> None:
        self.stop_token_ids = frozenset(stop_token_ids)
        self.grammars = grammars
        self.kernels = kernels
        self._generators: dict[torch.device, torch.Generator] = {}  # the unseeded rows' shared one, per device

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | SamplingError]:
        drawn = self.draw(logits, seqs)
        return drawn.resolve(drawn.tokens.tolist())

    def draw(self, logits: torch.Tensor, seqs: list[Sequence], unseen: UnseenTokens | None = None) -> Draw:
        """The rows' tokens queued on the device (nothing waits for them). ``unseen``: tokens of these sequences
        that a step queued ahead sampled and the host has not read (the penalties and ``min_tokens`` count them)."""
        constrained = [row for row, seq in enumerate(seqs) if seq.matcher is not None and not seq.is_finished]
        bitmask = self.grammars.bitmask([seqs[row].matcher for row in constrained]) if constrained else None
        logprob_rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
        log_probs = _log_softmax(logits, logprob_rows, constrained, bitmask)
        controlled = apply_logit_controls(logits, seqs, self.stop_token_ids, unseen)
        if constrained:
            controlled = controlled.clone() if controlled is logits else controlled
            apply_token_bitmask(controlled, constrained, bitmask)
        logits = controlled
        tokens = self._argmax(logits)
        # a NaN wins the argmax, +inf is no choice either, and -inf is a token nothing allows: such a greedy row
        # fails, as a drawn one does
        tokens = _drawable(logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), tokens)
        failed: dict[int, SamplingError] = {}
        for row, seq in enumerate(seqs):
            if not seq.params.greedy and seq.params.seed is not None and seq.generator is None:
                try:
                    seq.generator = request_generator(seq.params.seed, logits.device)
                except (RuntimeError, ValueError) as e:
                    failed[row] = sampling_error(seq, e)
        rows = [row for row, seq in enumerate(seqs) if not seq.params.greedy and row not in failed]
        if rows:
            index = device_tensor(rows, torch.long, logits.device)
            tokens[index] = self._draw(logits[index].float(), [seqs[row] for row in rows])  # a copy of the rows
        drawn = Draw(tokens, seqs, failed)
        if logprob_rows:
            chosen = tokens[device_tensor(logprob_rows, torch.long, tokens.device)].clamp(min=0)
            most = max(seqs[row].params.logprobs for row in logprob_rows)
            drawn.logprobs = DrawnLogprobs(logprob_rows, *chosen_logprobs(log_probs, chosen),
                                           log_probs.topk(most, dim=-1) if most else None)
        return drawn

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row of ``logits`` [m, vocab] (row i is ``seqs[i]``'s; overwritten), or why there is none
        (``_drawable``). The race runs in log space, ``argmax(x - log q)``: no normalisation,
        so a row's draw depends on its own logits and ``q`` alone."""
        device, vocab = logits.device, logits.shape[-1]
        params = [seq.params for seq in seqs]
        most = torch.finfo(logits.dtype).max  # a larger temperature would round to inf, and -inf / inf is NaN
        temperature = device_tensor([min(p.temperature, most) for p in params], logits.dtype, device)
        x = logits.div_(temperature.unsqueeze(-1))
        if any(p.min_p > 0 for p in params):  # after the temperature and before top-k and top-p, as in vLLM
            x = apply_min_p(x, [p.min_p for p in params])
        if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
            x = apply_top_k_top_p(x, [p.top_k for p in params], [p.top_p for p in params])
        q = torch.empty_like(x)
        if all(seq.generator is None for seq in seqs):
            q.exponential_(generator=self._shared_generator(device))
        else:
            for i, seq in enumerate(seqs):
                q[i].exponential_(generator=seq.generator or self._shared_generator(device))
        tokens = self._argmax(q.clamp_(min=torch.finfo(q.dtype).tiny).log_().neg_().add_(x))
        return _drawable(x.amax(-1), tokens)  # amax is NaN with a NaN in the row, -inf with none left

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(-1)`` of ``x`` [n, vocab]."""
        if self.kernels.use_triton(x) and x.stride(-1) == 1:
            from kiln.runtime.native.kernels.argmax import argmax_rows

            return argmax_rows(x)
        return x.argmax(-1)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        """The unseeded rows' generator on ``device``, randomly seeded once."""
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(random.SystemRandom().getrandbits(63))
            self._generators[device] = generator
        return self._generators[device]
