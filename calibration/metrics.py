"""The quantized model against the unquantized one on held-out rows: KL, top-1 agreement, perplexity, output MAE."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.calibration.batching import BatchRunner

CACHE_LIMIT_BYTES = 1 << 30  # reference logits up to 1 GiB stay in memory; above that they are recomputed


@dataclass(frozen=True)
class HeldoutMetrics:
    """kl: mean KL(reference || quantized) of the next-token distributions, nats per token; top1_agreement: share
    of positions where both models pick the same next token; ppl_increase: ppl / reference_ppl - 1;
    output_mae: mean absolute difference of the logits."""

    kl: float
    top1_agreement: float
    ppl: float
    reference_ppl: float
    ppl_increase: float
    output_mae: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class HeldoutReference:
    """The unquantized model's logits on the held-out rows, computed once (and kept when they fit in memory)."""

    def __init__(self, model: nn.Module, rows: torch.Tensor, runner: BatchRunner):
        self.model = model
        self.rows = rows
        self.runner = runner
        vocab = model.get_output_embeddings().out_features
        self.cached: torch.Tensor | None = None
        if rows.numel() * vocab * 4 <= CACHE_LIMIT_BYTES:
            self.cached = torch.cat([self._compute(span).cpu() for span in runner.spans(len(rows))])
        else:
            for span in runner.spans(len(rows)):  # still check once that the reference is finite
                self._compute(span)

    def _compute(self, span: slice) -> torch.Tensor:
        return self.runner.logits(self.model, self.rows[span], "unquantized model on held-out data")

    def logits(self, span: slice) -> torch.Tensor:
        if self.cached is not None:
            return self.cached[span].to(self.runner.device)
        return self._compute(span)


def evaluate(model: nn.Module, reference: HeldoutReference, what: str) -> HeldoutMetrics:
    """Compare `model` with the reference on every held-out row."""
    runner, rows = reference.runner, reference.rows
    kl = agree = mae = nll = ref_nll = 0.0
    positions = predicted = 0
    for span in runner.spans(len(rows)):
        ids = rows[span].to(runner.device)
        logits = runner.logits(model, ids, what)
        logp = F.log_softmax(logits, dim=-1)
        ref_logits = reference.logits(span)
        ref_logp = F.log_softmax(ref_logits, dim=-1)
        kl += (ref_logp.exp() * (ref_logp - logp)).sum(-1).sum().item()
        agree += (logp.argmax(-1) == ref_logp.argmax(-1)).sum().item()
        mae += (logits - ref_logits).abs().mean(-1).sum().item()
        positions += ids.numel()
        targets = ids[:, 1:].unsqueeze(-1)
        nll -= logp[:, :-1].gather(-1, targets).sum().item()
        ref_nll -= ref_logp[:, :-1].gather(-1, targets).sum().item()
        predicted += targets.numel()
    ppl, reference_ppl = math.exp(nll / predicted), math.exp(ref_nll / predicted)
    return HeldoutMetrics(
        kl=kl / positions,
        top1_agreement=agree / positions,
        ppl=ppl,
        reference_ppl=reference_ppl,
        ppl_increase=ppl / reference_ppl - 1,
        output_mae=mae / positions,
    )
