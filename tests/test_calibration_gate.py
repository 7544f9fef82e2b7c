"""The accuracy gate's verdict at, just inside and just past each threshold, one figure at a time."""

from __future__ import annotations

import pytest

from kiln.calibration.gate import check_gate
from kiln.calibration.metrics import HeldoutMetrics

THRESHOLDS = {"max_ppl_increase": 0.05, "max_kl": 0.02, "min_top1_agreement": 0.9}


def metrics(ppl_increase: float = 0.01, kl: float = 0.001, top1_agreement: float = 0.99) -> HeldoutMetrics:
    return HeldoutMetrics(kl=kl, top1_agreement=top1_agreement, ppl=2.0 * (1 + ppl_increase), reference_ppl=2.0,
                          ppl_increase=ppl_increase, output_mae=0.1)


@pytest.mark.parametrize(("figure", "inside", "at", "past", "named"), [
    ("ppl_increase", 0.04, 0.05, 0.0501, "max_ppl_increase"),
    ("kl", 0.01, 0.02, 0.0201, "max_kl"),
    ("top1_agreement", 0.95, 0.9, 0.8999, "min_top1_agreement"),
])
def test_each_figure_passes_inside_and_at_its_threshold_and_fails_past_it(figure, inside, at, past, named):
    for value in (inside, at):
        result = check_gate(metrics(**{figure: value}), THRESHOLDS)
        assert result.passed and result.failures == [], (figure, value)
    failed = check_gate(metrics(**{figure: past}), THRESHOLDS)
    assert not failed.passed and len(failed.failures) == 1 and named in failed.failures[0]


def test_every_failing_figure_is_named():
    result = check_gate(metrics(ppl_increase=0.5, kl=0.5, top1_agreement=0.5), THRESHOLDS)
    assert not result.passed and [f.split()[0] for f in result.failures] == ["ppl", "KL", "top-1"]
    assert result.as_dict()["failures"] == result.failures and result.as_dict()["applied"] is True
