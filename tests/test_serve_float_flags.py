"""`kiln serve`'s float flags refuse inf and nan as not finite whatever bounds they have, and still hold their
bounds."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kiln.pipeline.cli import app

FLOAT_FLAGS = ["--max-body-mb", "--timeout-keep-alive", "--shutdown-timeout", "--gpu-memory-utilization"]


def _serve_error(*args: str) -> str:
    result = CliRunner().invoke(app, ["serve", "no-such-engine", *args])
    assert result.exit_code == 2
    return " ".join(result.output.split())


@pytest.mark.parametrize("flag", FLOAT_FLAGS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_float_flag_refuses_nan_and_inf_as_not_finite_before_its_bounds(flag, value):
    assert f"error: Invalid value for '{flag}': {value} is not a finite number" in _serve_error(f"{flag}={value}")


@pytest.mark.parametrize(("flag", "value", "words"), [
    ("--gpu-memory-utilization", "1.5", "less than or equal to 1"),
    ("--gpu-memory-utilization", "0", "greater than or equal to 0.01"),
    ("--shutdown-timeout", "-1", "greater than or equal to 0"),
    ("--max-body-mb", "abc", "'abc' is not a number"),
])
def test_a_float_flag_still_holds_its_bounds(flag, value, words):
    assert f"error: Invalid value for '{flag}': " in (output := _serve_error(f"{flag}={value}")) and words in output
