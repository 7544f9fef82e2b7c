"""The accuracy gate: held-out perplexity increase, KL and top-1 agreement against thresholds."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.calibration.metrics import HeldoutMetrics


@dataclass(frozen=True)
class GateResult:
    passed: bool
    metrics: HeldoutMetrics
    thresholds: dict[str, float]
    failures: list[str]

    def as_dict(self) -> dict:
        return {"passed": self.passed, **self.metrics.as_dict(), "thresholds": dict(self.thresholds),
                "failures": list(self.failures)}


def check_gate(metrics: HeldoutMetrics, thresholds: dict[str, float]) -> GateResult:
    """Pass when the perplexity increase and KL are at most, and the top-1 agreement at least, their thresholds."""
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
