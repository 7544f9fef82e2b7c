"""``kiln serve --log-config``: every line of every process goes where and how the configuration file says, stdout
included; without one, nothing changes."""

from __future__ import annotations

import json
import subprocess
import sys

from kiln.engines.cache import EngineCache
from tests.subprocess_env import REPO, repo_env

# What kiln serve does with its logging, in a process of its own as the CLI runs it: set it up, log a line of the
# server's, print the command's own lines (a warning, a build stage's progress), start a process that logs as this
# one does (the engine process, a tensor-parallel worker), then fail as a server whose engine did not load.
SERVE_LOGGING = """
import logging, subprocess, sys
import typer
from kiln.pipeline.console import friendly_errors, stage_progress, warn
from kiln.pipeline.serve_command import log_to_stderr
from kiln.runtime.errors import KilnError
from kiln.runtime.logs import child_logging

CHILD = ("import logging, sys; from kiln.runtime.logs import log_as_parent; log_as_parent(int(sys.argv[1]), "
         "sys.argv[2]); logging.getLogger('kiln.runtime').info('from the engine process')")

@friendly_errors
def serve():
    log_to_stderr("info", sys.argv[1] or None)
    logging.getLogger("kiln.server").info("from the server")
    warn("listening without an API key")
    with stage_progress(enabled=True) as progress:
        progress("build")("building native engine", 0.5)
    subprocess.run([sys.executable, "-c", CHILD, *child_logging()], check=True)
    raise KilnError("the engine failed to load")

try:
    serve()
except typer.Exit as exc:
    sys.exit(exc.exit_code)
"""

STDOUT_JSON = {
    "version": 1,
    "formatters": {"json": {"format": '{"logger": "%(name)s", "level": "%(levelname)s", "message": "%(message)s"}'}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stdout"}},
    "root": {"handlers": ["out"], "level": "INFO"}}


def _serve(config: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SERVE_LOGGING, config], capture_output=True, text=True, cwd=REPO,
                          env=repo_env(), timeout=60)


def test_a_log_config_of_stdout_gets_every_line_of_every_process_there_in_its_format(tmp_path):
    config = tmp_path / "logging.json"
    config.write_text(json.dumps(STDOUT_JSON))
    done = _serve(str(config))
    assert done.returncode == 2, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]  # before: nothing on stdout, all on stderr
    assert lines == [
        {"logger": "kiln.server", "level": "INFO", "message": "from the server"},
        {"logger": "kiln.pipeline", "level": "WARNING", "message": "listening without an API key"},
        {"logger": "kiln.pipeline", "level": "INFO", "message": "build: building native engine"},
        {"logger": "kiln.runtime", "level": "INFO", "message": "from the engine process"},
        {"logger": "kiln.pipeline", "level": "ERROR", "message": "the engine failed to load"}], done.stdout
    assert done.stderr == ""  # before: the warning, the progress and the error as plain text there


def test_without_a_log_config_the_lines_stay_on_stderr_as_kiln_prints_them():
    done = _serve("")
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert " INFO kiln.server [-]: from the server\n" in done.stderr
    assert "warning: listening without an API key\n" in done.stderr
    assert "build     building native engine\n" in done.stderr
    assert " INFO kiln.runtime [-]: from the engine process\n" in done.stderr
    assert done.stderr.endswith("error: the engine failed to load\n"), done.stderr


# Two commands in one process, as typer's test runner or an embedder runs them: serve with a logging configuration
# file (its lines go there), then a command given none.
SERVE_THEN_ANOTHER = """
import json, sys
from typer.testing import CliRunner
from kiln.pipeline.cli import app
served = CliRunner().invoke(app, ["serve", "/nonexistent", "--log-config", sys.argv[1]])
shown = CliRunner().invoke(app, ["cache", "show", "00"])
print(json.dumps([served.exit_code, served.stderr, shown.exit_code, shown.stderr]))
"""


def test_a_later_command_in_the_same_process_prints_its_error_again_on_stderr(tmp_path):
    log = tmp_path / "kiln.log"
    config = tmp_path / "logging.json"
    config.write_text(json.dumps({"version": 1, "root": {"handlers": ["file"], "level": "INFO"},
                                  "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log)}}}))
    EngineCache.open(tmp_path / "cache")  # a cache there: the later command's error is about its key, wherever run
    done = subprocess.run([sys.executable, "-c", SERVE_THEN_ANOTHER, str(config)], capture_output=True, text=True,
                          cwd=REPO, env=repo_env(KILN_CACHE=str(tmp_path / "cache")), timeout=60)
    served_code, served_err, shown_code, shown_err = json.loads(done.stdout.splitlines()[-1])
    assert (served_code, served_err) == (2, "") and "/nonexistent" in log.read_text()
    assert shown_code == 2 and shown_err.startswith("error: '00' is not a cache key"), shown_err  # before: ""
    assert "'00'" not in log.read_text()
