"""Log probabilities computed on the device, brought to the host as ``TokenLogprob``s (sampled and prompt tokens
alike)."""

from __future__ import annotations

import math

import torch

from kiln.runtime.outputs import TokenLogprob


def chosen_logprobs(log_probs: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log probability of its token in ``token_ids`` [rows] under ``log_probs`` [rows, vocab], and the
    token's rank as vLLM counts it: how many tokens are at least as likely (1 for the most likely)."""
    chosen = log_probs.gather(-1, token_ids.unsqueeze(-1))
    return chosen.squeeze(-1), (log_probs >= chosen).sum(-1)


def token_logprobs(token_ids: list[int], chosen: torch.Tensor, ranks: torch.Tensor, top_values: torch.Tensor | None,
                   top_ids: torch.Tensor | None, widths: list[int]) -> list[TokenLogprob]:
    """Row ``i``: token ``token_ids[i]`` with log probability ``chosen[i]``, rank ``ranks[i]`` and the first
    ``widths[i]`` of its row of ``top_values`` / ``top_ids`` (the most likely tokens, most likely first) as
    alternatives; a token that was impossible (-inf: a structured output's grammar forbade it) is no alternative."""
    chosen_host, ranks_host = chosen.tolist(), ranks.tolist()
    values, ids = (top_values.tolist(), top_ids.tolist()) if top_ids is not None else ([], [])
    return [TokenLogprob(token, logprob, [(t, v) for t, v in zip(ids[i][:width], values[i][:width], strict=True)
                                          if v > -math.inf] if width else [], rank)
            for i, (token, logprob, rank, width) in enumerate(zip(token_ids, chosen_host, ranks_host, widths,
                                                                  strict=True))]
