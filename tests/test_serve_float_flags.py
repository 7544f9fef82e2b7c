"""The float flags of `kiln serve`, `kiln bench` and `kiln loadtest` refuse inf and nan as not finite whatever bounds
they have, and still hold their bounds."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kiln.pipeline.cli import app

FLOAT_FLAGS = ["--max-body-mb", "--timeout-keep-alive", "--shutdown-timeout", "--gpu-memory-utilization"]
BENCH_FLOAT_FLAGS = [("bench", "--bandwidth-gbs"), ("loadtest", "--spread"), ("loadtest", "--disconnect"),
                     ("loadtest", "--max-failure-rate")]


def _error(command: str, *args: str) -> str:
    result = CliRunner().invoke(app, [command, "no-such-engine", *args])
    assert result.exit_code == 2
    return " ".join(result.output.split())


def _serve_error(*args: str) -> str:
    return _error("serve", *args)


@pytest.mark.parametrize("flag", FLOAT_FLAGS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_float_flag_refuses_nan_and_inf_as_not_finite_before_its_bounds(flag, value):
    assert f"error: Invalid value for '{flag}': {value} is not a finite number" in _serve_error(f"{flag}={value}")


@pytest.mark.parametrize(("command", "flag"), BENCH_FLOAT_FLAGS)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_bench_and_loadtest_float_flags_refuse_nan_and_inf_as_they_are_parsed(command, flag, value):
    output = _error(command, f"{flag}={value}")  # before: nan was "not in the range", inf passed to the run
    assert f"Invalid value for '{flag}': {value} is not a finite number" in output, output


@pytest.mark.parametrize(("flag", "value", "words"), [
    ("--gpu-memory-utilization", "1.5", "less than or equal to 1"),
    ("--gpu-memory-utilization", "0", "greater than or equal to 0.01"),
    ("--shutdown-timeout", "-1", "greater than or equal to 0"),
    ("--max-body-mb", "abc", "'abc' is not a number"),
])
def test_a_float_flag_still_holds_its_bounds(flag, value, words):
    assert f"error: Invalid value for '{flag}': " in (output := _serve_error(f"{flag}={value}")) and words in output
