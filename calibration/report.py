"""What a quantize run records: the rounds of each attempted format, the verdict, the gate, and the JSON report."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from kiln.calibration.gate import GateResult

UNSETTLED_SHOWN = 5


@dataclass
class RoundRecord:
    """One calibration round: cumulative samples, the largest statistic change, and the held-out comparison."""

    round: int
    samples: int
    max_rel_change: float | None
    most_changed: str | None
    kl: float
    top1_agreement: float
    output_mae: float
    seconds: float

    def as_dict(self) -> dict:
        return {k: _finite(v) for k, v in self.__dict__.items()}


@dataclass
class Attempt:
    """One format of the chain: its rounds, convergence verdict, gate result and outcome."""

    format: str
    rounds: list[RoundRecord] = field(default_factory=list)
    converged: bool = False
    unsettled: list[tuple[str, float | None]] = field(default_factory=list)
    gate: GateResult | None = None
    outcome: str = ""
    seconds: float = 0.0

    @property
    def samples(self) -> int:
        return self.rounds[-1].samples if self.rounds else 0

    @property
    def verdict(self) -> str:
        if self.format == "none":
            return "not needed"
        return "converged" if self.converged else "not converged"

    def gate_dict(self) -> dict | None:
        """The gate's result; None for a quantized format that was never gated (it did not converge, or the recipe
        has no gate); for format none, which needs no gate, the reference's own figures."""
        if self.gate is not None:
            return self.gate.as_dict()
        if self.format != "none":
            return None
        return {"passed": True, "ppl_increase": 0.0, "kl": 0.0, "top1_agreement": 1.0,
                "note": "unquantized: identical to the reference"}

    def as_dict(self) -> dict:
        return {
            "format": self.format,
            "verdict": self.verdict,
            "converged": self.converged,
            "samples": self.samples,
            "rounds": [r.as_dict() for r in self.rounds],
            "unsettled": [{"statistic": n, "recent_change": _finite(c)} for n, c in self.unsettled],
            "gate": self.gate_dict(),
            "outcome": self.outcome,
            "seconds": round(self.seconds, 3),
        }


def unsettled_text(attempt: Attempt) -> str:
    """The unsettled statistics with their last change, the worst first, a few by name."""
    shown = ", ".join(
        f"{name} ({'no change measured yet' if c is None else f'recent change {c:.1%}'})"
        for name, c in attempt.unsettled[:UNSETTLED_SHOWN]
    )
    more = len(attempt.unsettled) - UNSETTLED_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def summary_line(shipped: Attempt, attempts: list[Attempt], tolerance: float) -> str:
    """One line for a person: which format shipped, whether calibration converged, the gate figures, and why."""
    if shipped.format == "none" and len(attempts) == 1:
        return "none: unquantized checkpoint, no calibration needed"
    parts = [shipped.format + ":"]
    if shipped.format != "none":
        last = shipped.rounds[-1]
        change = "" if last.max_rel_change is None else f", last max change {last.max_rel_change:.2%}"
        rounds = f"{len(shipped.rounds)} round{'' if len(shipped.rounds) == 1 else 's'}"
        parts.append(f"{shipped.verdict} after {rounds} ({shipped.samples} samples{change}, "
                     f"tolerance {tolerance * 100:.3g}%);")
        g = shipped.gate
        parts.append(f"gate {'passed' if g.applied else 'not applied'} (ppl {g.metrics.ppl_increase:+.2%}, "
                     f"KL {g.metrics.kl:.2g}, top-1 {g.metrics.top1_agreement:.2%})")
    failed = [a for a in attempts if a is not shipped]
    if failed:
        parts.append("after fallback: " + outcomes_text(failed))
    return " ".join(parts)


def outcomes_text(attempts: list[Attempt]) -> str:
    """``fp8 failed the gate: ...; int4_awq passed`` for the attempts, in order."""
    return "; ".join(f"{a.format} {a.outcome}" for a in attempts)


def build_report(attempts: list[Attempt], requested: str, context: dict, tolerance: float) -> dict:
    """The calibration_report.json content; `context` adds the run's settings, hashes and times."""
    shipped = attempts[-1]
    return {
        "format": shipped.format,
        "requested_format": requested,
        "converged": shipped.converged,
        "verdict": shipped.verdict,
        "rounds": [r.as_dict() for r in shipped.rounds],
        "unsettled": [{"statistic": n, "recent_change": _finite(c)} for n, c in shipped.unsettled],
        "gate": shipped.gate_dict(),
        "fallback_from": requested if shipped.format != requested else None,
        "reason": shipped.outcome,
        "samples_used": shipped.samples,
        "attempts": [a.as_dict() for a in attempts],
        "summary": summary_line(shipped, attempts, tolerance),
        **context,
    }


def write_report(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _finite(value):
    """JSON has no infinity or NaN: such a value is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
