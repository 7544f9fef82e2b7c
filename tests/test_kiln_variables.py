"""Every ``KILN_*`` variable Kiln reads is named in one place, and a command warns of any other: a misspelt one
would otherwise change nothing, silently."""

from __future__ import annotations

import ast
import re

from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.runtime_env import KNOWN_VARIABLES, unknown_variables
from tests.subprocess_env import REPO


def _variables_in_source() -> set[str]:
    """The KILN_* names in the string literals (messages, docstrings, environment keys) of Kiln's Python source: not
    the tests', nor a hidden folder's (the virtualenv, an old wheel's copy)."""
    found = set()
    tops = [top for top in REPO.iterdir() if top.name != "tests" and not top.name.startswith(".")]
    sources = [top for top in tops if top.suffix == ".py"] + [path for top in tops if top.is_dir()
                                                             for path in top.rglob("*.py")]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.update(re.findall(r"\bKILN_[A-Z0-9_]*[A-Z0-9]\b", node.value))
    return found


def test_the_known_variables_are_those_the_source_reads_no_more_no_fewer():
    assert _variables_in_source() == KNOWN_VARIABLES


def test_a_misspelt_variable_is_named_with_the_one_it_is_closest_to():
    warnings = unknown_variables({"KILN_PREFIX_CACHNG": "0", "KILN_SCHEDULR_POLICY": "fcfs", "KILN_HOME": "/x",
                                  "KILN_CACHE": "/c", "HOME": "/h", "KILN_CACHE_REMOTE_ENDPOINT": "http://s3",
                                  "kiln_kernels": "torch"})
    assert warnings == [
        "KILN_CACHE_REMOTE_ENDPOINT is not a variable Kiln reads, so it changes nothing; unset it",  # no typo
        "KILN_HOME is not a variable Kiln reads, so it changes nothing; unset it",
        "KILN_PREFIX_CACHNG is not a variable Kiln reads, so it changes nothing; did you mean KILN_PREFIX_CACHING?",
        "KILN_SCHEDULR_POLICY is not a variable Kiln reads, so it changes nothing; did you mean "
        "KILN_SCHEDULER_POLICY?",
        "kiln_kernels is not a variable Kiln reads, so it changes nothing; did you mean KILN_KERNELS?"]


def test_every_command_warns_once_of_a_variable_kiln_does_not_read(tmp_path):
    result = CliRunner().invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path)],
                                env={"KILN_PREFIX_CACHNG": "0"})
    text = " ".join(result.output.split())
    assert text.count("warning: KILN_PREFIX_CACHNG is not a variable Kiln reads") == 1, text
    assert "did you mean KILN_PREFIX_CACHING?" in text
