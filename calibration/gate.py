"""The accuracy gate: held-out perplexity increase, KL and top-1 agreement against thresholds."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.calibration.metrics import HeldoutMetrics


@dataclass(frozen=True)
class GateResult:
    """The held-out figures and the verdict; ``thresholds`` is None when the recipe applies no gate (``gate: null``),
    and then the figures are only recorded."""

    passed: bool
    metrics: HeldoutMetrics
    thresholds: dict[str, float] | None
    failures: list[str]

    @property
    def applied(self) -> bool:
        return self.thresholds is not None

    def as_dict(self) -> dict:
        """As the report gives it: ``passed`` null where no gate was applied (nothing was checked)."""
        return {"passed": self.passed if self.applied else None, "applied": self.applied, **self.metrics.as_dict(),
                "thresholds": self.thresholds, "failures": list(self.failures)}


def check_gate(metrics: HeldoutMetrics, thresholds: dict[str, float] | None) -> GateResult:
    """Pass when the perplexity increase and KL are at most, and the top-1 agreement at least, their thresholds (no
    thresholds: pass, recording the figures)."""
    if thresholds is None:
        return GateResult(passed=True, metrics=metrics, thresholds=None, failures=[])
    failures = []
    if metrics.ppl_increase > thresholds["max_ppl_increase"]:
        failures.append(f"ppl +{metrics.ppl_increase:.2%} > max_ppl_increase {thresholds['max_ppl_increase']:.2%}")
    if metrics.kl > thresholds["max_kl"]:
        failures.append(f"KL {metrics.kl:.4g} > max_kl {thresholds['max_kl']:.4g}")
    if metrics.top1_agreement < thresholds["min_top1_agreement"]:
        failures.append(
            f"top-1 {metrics.top1_agreement:.2%} < min_top1_agreement {thresholds['min_top1_agreement']:.2%}"
        )
    return GateResult(passed=not failures, metrics=metrics, thresholds=thresholds, failures=failures)
