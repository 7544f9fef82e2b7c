"""On the bundled tiny Llama, both formats converge within their default budgets and pass their default gates."""

from __future__ import annotations

import pytest

from kiln.calibration import QuantizeRecipe
from kiln.calibration.quantize import quantize_checkpoint
from tests.calibration_factories import TINY_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
def test_tiny_model_converges_and_passes_the_default_gate(tmp_path, fmt):
    report = quantize_checkpoint(TINY_MODEL, QuantizeRecipe(format=fmt), tmp_path)
    assert report["format"] == fmt and report["converged"] is True and report["gate"]["passed"] is True
    assert report["samples_used"] <= QuantizeRecipe().num_samples
    changes = [r["max_rel_change"] for r in report["rounds"][1:]]
    assert changes[-1] < QuantizeRecipe().tolerance < changes[0]
    assert report["gate"]["top1_agreement"] > 0.95 and report["gate"]["kl"] < 0.01
