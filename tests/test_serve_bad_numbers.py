"""Numbers `kiln serve` cannot use (an infinite float flag, a WORLD_SIZE torchrun would never set) are refused in one
line naming the flag or the variable, before anything is built, not as a traceback once it is."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kiln.pipeline.cli import app


def _serve(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["serve", "no-such-engine", *args], env=env)
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("flag", ["--max-body-mb", "--timeout-keep-alive", "--shutdown-timeout",
                                  "--gpu-memory-utilization"])
@pytest.mark.parametrize("value", ["inf", "1e999", "nan"])
def test_a_float_flag_that_is_not_finite_is_refused_naming_the_flag(flag, value):
    code, output = _serve(flag, value)
    assert code == 2 and f"error: Invalid value for '{flag}'" in output, output
    assert "no-such-engine" not in output  # refused before the target is looked for


@pytest.mark.parametrize("value", ["abc", "", "٢"])
def test_a_world_size_that_is_not_a_whole_number_is_refused_naming_it(value):
    code, output = _serve(env={"WORLD_SIZE": value, "RANK": "0"})
    assert code == 2 and f"error: WORLD_SIZE={value!r} is not a whole number" in output, output
    assert "Traceback" not in output


def test_kiln_tp_port_is_said_to_be_the_users_to_set_and_torchruns_variables_torchruns():
    from kiln.runtime.errors import TensorParallelError
    from kiln.runtime.native.parallel.group import Rendezvous

    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}
    with pytest.raises(TensorParallelError, match=r"KILN_TP_PORT='x' is not a whole number; set it to a free TCP port"):
        Rendezvous.from_environment({**env, "KILN_TP_PORT": "x"})
    with pytest.raises(TensorParallelError, match=r"RANK='١' is not a whole number; torchrun sets it"):
        Rendezvous.from_environment({**env, "RANK": "١"})
