"""What a request asks to change in the model's logits before sampling: a minimum length, a logit bias, the tokens
it allows, and the presence, frequency and repetition penalties (``SamplingParams``), applied to a step's rows on the
device.

Only the rows of requests that ask are touched, on a float32 copy (the logits may be a CUDA graph's output buffer,
and in bf16, whose step near a logit of 20 is 0.125, a penalty of 0.05 or a bias of 0.3 would round away). The order
is vLLM's: the allowed tokens, the minimum length and the bias, then the repetition penalty (transformers' rule, over
the prompt and the completion), then the frequency and presence penalties (OpenAI's rule, over the completion).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from kiln.runtime.native.device_copy import device_tensor
from kiln.runtime.sequence import Sequence


@dataclass(frozen=True)
class UnseenTokens:
    """Tokens a step queued ahead has sampled that the host has not read yet: ``rows`` of the batch (host) and the
    same rows and their tokens on the device."""

    rows: list[int]
    device_rows: torch.Tensor
    tokens: torch.Tensor


def apply_logit_controls(logits: torch.Tensor, seqs: list[Sequence], stop_token_ids: Collection[int],
                         unseen: UnseenTokens | None = None) -> torch.Tensor:
    """``logits`` [n, vocab] (row i is ``seqs[i]``'s next token) with each request's controls applied, in float32;
    the same tensor when no row asks for any. ``stop_token_ids`` (the engine's EOS) are banned, with each request's
    own stop tokens, until it has ``min_tokens`` completion tokens; a request's ``allowed_token_ids`` leave every
    other token at -inf. ``unseen`` holds tokens of these sequences still on the device, which count as completion
    tokens."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.controls_logits]
    if not rows:
        return logits
    logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
    unseen_rows = set(unseen.rows) if unseen is not None else set()
    _apply_allowed_token_ids(logits, [(i, seqs[i]) for i in rows if seqs[i].params.allowed_token_ids is not None])
    _apply_bias_and_min_tokens(logits, [(i, seqs[i]) for i in rows], stop_token_ids, unseen_rows)
    penalized = [i for i in rows if seqs[i].params.penalizes_repeats]
    if penalized:
        logits[penalized] = _penalized([seqs[i] for i in penalized], logits[penalized], _unseen_of(unseen, penalized))
    return logits


def _apply_allowed_token_ids(logits: torch.Tensor, rows: list[tuple[int, Sequence]]) -> None:
    """-inf in each of ``rows`` (row, its sequence) on every token its request does not allow; each request's ids
    go to the device once (a list of half a vocabulary, rebuilt every step, took 100 ms)."""
    if not rows:
        return
    device = logits.device
    ids = [_allowed_ids(seq, device) for _, seq in rows]
    allowed = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=device)
    positions = torch.repeat_interleave(torch.arange(len(rows), device=device),
                                        device_tensor([len(row_ids) for row_ids in ids], torch.long, device))
    allowed[positions, torch.cat(ids)] = True
    index = device_tensor([i for i, _ in rows], torch.long, device)
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))


def _allowed_ids(seq: Sequence, device: torch.device) -> torch.Tensor:
    """The request's ``allowed_token_ids`` as a tensor on ``device``, made at its first use."""
    if seq.allowed_ids is None:
        seq.allowed_ids = device_tensor(sorted(set(seq.params.allowed_token_ids)), torch.long, device)
    return seq.allowed_ids


def _apply_bias_and_min_tokens(logits: torch.Tensor, rows: list[tuple[int, Sequence]], stop_token_ids: Collection[int],
                               unseen_rows: set[int]) -> None:
    biased = [(i, token_id, bias) for i, seq in rows for token_id, bias in seq.params.logit_bias.items()]
    if biased:
        index, token_ids, biases = zip(*biased, strict=True)
        logits.index_put_((device_tensor(list(index), torch.long, logits.device),
                           device_tensor(list(token_ids), torch.long, logits.device)),
                          device_tensor(list(biases), logits.dtype, logits.device), accumulate=True)
    banned = [(i, token_id) for i, seq in rows
              if seq.num_completion_tokens + (i in unseen_rows) < seq.params.min_tokens
              for token_id in {*seq.params.stop_token_ids, *stop_token_ids}  # EOS too with ignore_eos, as vLLM
              if token_id < logits.shape[-1]]  # an EOS past the model's vocabulary (an older engine's) is never drawn
    if banned:
        index, token_ids = zip(*banned, strict=True)
        logits[device_tensor(list(index), torch.long, logits.device),
               device_tensor(list(token_ids), torch.long, logits.device)] = float("-inf")


def _unseen_of(unseen: UnseenTokens | None, rows: list[int]) -> tuple[list[int], torch.Tensor] | None:
    """The positions in ``rows`` that have an unseen token, and those tokens."""
    if unseen is None:
        return None
    position = {row: p for p, row in enumerate(rows)}
    picked = [(position[row], k) for k, row in enumerate(unseen.rows) if row in position]
    if not picked:
        return None
    index = device_tensor([k for _, k in picked], torch.long, unseen.tokens.device)
    return [p for p, _ in picked], unseen.tokens[index]


def _penalized(seqs: list[Sequence], x: torch.Tensor, unseen: tuple[list[int], torch.Tensor] | None) -> torch.Tensor:
    """float32 logits ``x`` [m, vocab] of ``seqs`` with their repetition, frequency and presence penalties."""
    vocab, device = x.shape[-1], x.device
    counts = _token_counts([seq.completion_token_ids for seq in seqs], vocab, device)
    if unseen is not None:
        positions, tokens = unseen
        counts[device_tensor(positions, torch.long, device), tokens] += 1
    params = [seq.params for seq in seqs]
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        seen = (counts > 0) | (_token_counts([seq.prompt_token_ids for seq in seqs], vocab, device) > 0)
        penalty = device_tensor(repetition, torch.float32, device).unsqueeze(-1)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    frequency = device_tensor([p.frequency_penalty for p in params], torch.float32, device).unsqueeze(-1)
    presence = device_tensor([p.presence_penalty for p in params], torch.float32, device).unsqueeze(-1)
    return x - frequency * counts - presence * (counts > 0)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each list: float32 [len(token_lists), vocab]."""
    width = max(1, max(map(len, token_lists)))
    padded = [ids + [vocab] * (width - len(ids)) for ids in token_lists]  # id ``vocab``: a column dropped below
    ids = device_tensor(padded, torch.long, device)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))[:, :vocab]
