"""The CLI's stdout carries only results: what libraries print while a command runs goes to stderr."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
import typer

from tests.subprocess_env import REPO, repo_env

# A command as the CLI runs it (in a process of its own, stdout a pipe) that prints what modelopt prints when it
# compiles its CUDA extension (a Python print) and what C code writes to file descriptor 1, then its results.
NOISY_COMMAND = """
import os
import re
from kiln.pipeline.console import friendly_errors, print_json, stdout

@friendly_errors
def command():
    print("Loading extension modelopt_cuda_ext_fp8...")
    os.write(1, b"compiler output\\n")
    print_json({"engine_key": "ab"})
    stdout.print("a human-readable line")

command()
print("after the command")
"""


def test_json_results_stay_parseable_when_libraries_print_to_stdout():
    proc = subprocess.run([sys.executable, "-c", NOISY_COMMAND], capture_output=True, text=True, cwd=REPO,
                          env=repo_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    result, human = proc.stdout.split("}\n")
    assert json.loads(result + "}") == {"engine_key": "ab"}
    assert human == "a human-readable line\nafter the command\n"  # stdout is stdout again after the command
    assert "Loading extension modelopt_cuda_ext_fp8..." in proc.stderr and "compiler output" in proc.stderr


def test_an_error_under_json_is_an_error_object_on_stdout_with_the_exit_code_kept(tmp_path):
    from typer.testing import CliRunner

    from kiln.engines.cache import EngineCache
    from kiln.pipeline.cli import app

    EngineCache.open(tmp_path, max_size_bytes=None, max_entries=None)  # a cache, so that the key is what is wrong
    result = CliRunner().invoke(app, ["cache", "show", "zzzz", "--json", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]
    assert error["type"] == "InvalidCacheKeyError" and "not a cache key" in error["message"]
    plain = CliRunner().invoke(app, ["cache", "show", "zzzz", "--cache-dir", str(tmp_path)])
    assert plain.exit_code == 2 and plain.stdout == ""


def test_an_error_with_details_carries_them_in_its_json_object(capsys):
    from kiln.calibration import CalibrationError
    from kiln.pipeline.console import friendly_errors

    @friendly_errors
    def command(json_out: bool = True) -> None:
        raise CalibrationError("no format passed the accuracy gate", {"attempts": [{"format": "fp8"}]})

    with pytest.raises(typer.Exit) as exited:
        command(json_out=True)
    assert exited.value.exit_code == 4
    assert json.loads(capsys.readouterr().out)["error"]["details"] == {"attempts": [{"format": "fp8"}]}


def test_a_file_this_user_may_not_read_is_one_line_naming_it_not_a_traceback(capsys):
    from kiln.pipeline.console import friendly_errors

    @friendly_errors
    def command(json_out: bool = True) -> None:
        open_denied = PermissionError(13, "Permission denied")
        open_denied.filename = "/models/m/model.safetensors"
        raise open_denied

    with pytest.raises(typer.Exit) as exited:
        command(json_out=True)
    assert exited.value.exit_code == 2
    captured = capsys.readouterr()
    error = json.loads(captured.out)["error"]
    assert error["type"] == "PermissionError" and error["message"].startswith("/models/m/model.safetensors: Permission "
                                                                               "denied; give this user access")
    assert "Traceback" not in captured.err and "give this user access" in captured.err

    @friendly_errors
    def publish(json_out: bool = False) -> None:  # a rename into a folder this user may not write
        raise PermissionError(13, "Permission denied", "/cache/v1/tmp/entries.abc", None, "/cache/v1/entries/ab/abc")

    with pytest.raises(typer.Exit):
        publish()
    assert "/cache/v1/tmp/entries.abc -> /cache/v1/entries/ab/abc: Permission denied" in capsys.readouterr().err


def test_version_and_short_help():
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app
    from kiln.runtime.version import kiln_version

    installed = kiln_version()  # None on a machine that runs the checkout from PYTHONPATH
    printed = CliRunner().invoke(app, ["--version"]).stdout.strip()
    assert printed == (f"kiln {installed}" if installed else "kiln (not installed: run from a checkout)")
    short = CliRunner().invoke(app, ["-h"])
    assert short.exit_code == 0 and "Usage" in short.stdout and "build" in short.stdout


def test_help_names_every_option_whole_at_80_columns_and_no_command_prints_help_not_an_error():
    env = repo_env(COLUMNS="80")
    serve = subprocess.run([sys.executable, "-m", "kiln", "serve", "-h"], capture_output=True, text=True, cwd=REPO,
                           env=env)
    assert "--model-name, --served-model-name" in serve.stdout and "--gpu-memory-utilization" in serve.stdout
    bare = subprocess.run([sys.executable, "-m", "kiln", "cache"], capture_output=True, text=True, cwd=REPO, env=env)
    assert bare.returncode == 2 and bare.stderr.startswith("Usage:") and "error:" not in bare.stderr


def test_piped_output_never_wraps_a_long_path():
    long_path = "/cache/v1/entries/46/" + "4" * 64 + "/engine"
    code = f"from kiln.pipeline.console import stdout, stderr; stdout.print('engine    {long_path}'); " \
           f"stderr.print('error: {long_path} is gone')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=repo_env())
    assert proc.stdout == f"engine    {long_path}\n"
    assert proc.stderr == f"error: {long_path} is gone\n"
    table = ("from rich.table import Table; from kiln.pipeline.console import stdout; t = Table(); "
             f"t.add_column('stage'); t.add_column('reason'); t.add_row('build', 'engine {long_path}'); "
             "stdout.print(t)")
    proc = subprocess.run([sys.executable, "-c", table], capture_output=True, text=True, cwd=REPO,
                          env=repo_env(COLUMNS="30"))  # a table, into a pipe, even from a narrow terminal
    assert f"engine {long_path}" in proc.stdout


def test_without_a_terminal_progress_is_one_line_per_new_message(capsys):
    from kiln.pipeline.console import stage_progress

    with stage_progress(enabled=True) as stage:
        report = stage("build")
        note = "another process is building engine 0123456789ab; waiting for it"
        report(note, 0.0)
        report(note, 0.0)  # repeated: not printed again
        report("done", 1.0)
    assert capsys.readouterr().err.splitlines() == [f"build     {note}", "build     done"]


def test_a_usage_error_under_json_is_an_error_object_on_stdout():
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    result = CliRunner().invoke(app, ["build", "--json"])
    assert result.exit_code == 2
    assert json.loads(result.stdout) == {"error": {"type": "MissingParameter",
                                                   "message": "Missing argument 'config'."}}
    assert CliRunner().invoke(app, ["build"]).stdout == ""  # without --json, stdout stays empty


def test_a_usage_error_before_the_command_under_json_is_an_error_object_on_stdout_too():
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    for args in (["--json", "nosuchcommand"], ["--json", "build"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2
        assert json.loads(result.stdout) == {"error": {  # before: nothing on stdout
            "type": "NoSuchOption",
            "message": "No such option: --json (commands take it after their name: kiln build CONFIG --json)"}}


def test_a_usage_error_is_one_line_on_stderr_naming_the_help_to_read():
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    for args, message in ((["build", "--bogus"], "No such option: --bogus"), (["nosuch"], "No such command"),
                          (["--bogus"], "No such option"), (["cache", "ls", "--bogus"], "No such option"),
                          (["serve", "x", "--port", "abc"], "Invalid value for '--port'")):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
        assert result.stderr.startswith(f"error: {message}") and " -h`)" in result.stderr, (args, result.stderr)


def test_vllm_serve_flag_forms_are_taken_or_get_a_hint_naming_kilns(tmp_path):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    missing = str(tmp_path / "nothing")
    for args, words in ((["--served-model-name", "a", "b"], "repeat it for each (--served-model-name a "
                                                            "--served-model-name b)"),
                        (["--api-key", "k1", "k2"], "repeat it for each (--api-key k1 --api-key k2)")):
        result = CliRunner().invoke(app, ["serve", missing, *args])
        assert result.exit_code == 2 and words in result.stderr, result.stderr
    taken = ["--disable-log-requests", "--no-enable-log-requests", "--enable-chunked-prefill", "--disable-log-stats",
             "--enable-request-id-headers", "--allow-credentials",
             "--disable-uvicorn-access-log", "--allowed-methods", '["*"]', "--allowed-headers", "*"]
    result = CliRunner().invoke(app, ["serve", missing, *taken])
    assert result.exit_code == 2 and "No such option" not in result.stderr and "nothing" in result.stderr


def test_vllm_serve_flags_kiln_cannot_honour_are_refused_naming_what_it_does_instead(tmp_path):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    missing = str(tmp_path / "nothing")
    for args, words in ((["--enable-log-requests"], "Kiln logs no request's contents; --access-log logs a line"),
                        (["--trust-remote-code", "--max-model-len", "9", "--ssl-keyfile=k.pem", "--frob"],
                         "No such options: --trust-remote-code (vLLM's; Kiln runs no code a checkpoint ships"),
                        (["--max-model-len", "9", "--ssl-keyfile=k.pem"],
                         "--max-model-len (vLLM's; Kiln takes it as build.max_seq_len in the build config); "
                         "--ssl-keyfile (vLLM's; Kiln serves plain HTTP: terminate TLS at the proxy or ingress)"),
                        (["--served_model_name", "a"], "--served_model_name (write --served-model-name)"),
                        (["-tp", "2"], "-tp (vLLM's; Kiln takes it as build.tp_size"),  # before: "No such option: -t"
                        (["--allowed-methods", '["GET", "POST"]'], "allows every method and cannot narrow them"),
                        (["--allowed-headers", "authorization"], "allows every header and cannot narrow them")):
        result = CliRunner().invoke(app, ["serve", missing, *args])
        assert result.exit_code == 2 and words in result.stderr and "nothing" not in result.stderr, result.stderr


def test_vllms_tool_calling_flags_are_taken_and_a_parser_of_another_format_refused_before_anything_runs(tmp_path):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    missing = str(tmp_path / "nothing")
    hermes = ["--chat-template", "{% for t in tools %}{{ t }}{% endfor %} <tool_call>"]
    taken = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-log-len", "100",
             "--disable-fastapi-docs", *hermes]
    result = CliRunner().invoke(app, ["serve", missing, *taken])
    assert result.exit_code == 2 and "No such option" not in result.stderr and "nothing" in result.stderr
    for parser, words in (("mistral", "the chat template teaches hermes tool calls"),
                          ("pythonic", "not a format Kiln parses")):
        result = CliRunner().invoke(app, ["serve", missing, "--tool-call-parser", parser, *hermes])
        assert result.exit_code == 2 and words in result.stderr and "nothing" not in result.stderr, result.stderr


def test_vllms_disable_uvicorn_access_log_turns_the_access_log_off():
    from typer.main import get_command

    from kiln.pipeline.cli import app

    serve = get_command(app).commands["serve"]
    context = serve.make_context("serve", ["x", "--access-log", "--disable-uvicorn-access-log"])
    assert context.params["access_log"] is False


def test_an_interrupted_command_under_json_is_an_error_object_on_stdout_and_exit_130(capsys):
    from kiln.pipeline.console import friendly_errors

    @friendly_errors
    def command(json_out: bool = False) -> None:
        raise KeyboardInterrupt

    with pytest.raises(typer.Exit) as exit_:
        command(json_out=True)
    assert exit_.value.exit_code == 130
    assert json.loads(capsys.readouterr().out) == {"error": {"type": "KeyboardInterrupt", "message": "interrupted"}}


def test_sigterm_stops_a_command_as_ctrl_c_does_with_exit_143(capsys):
    import signal

    from kiln.pipeline.console import friendly_errors, stop_on_sigterm_as_on_ctrl_c

    cleaned = []

    @friendly_errors
    def command(json_out: bool = False) -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # CI cancelling the job; before: killed, its temporary files left
        finally:
            cleaned.append(True)  # as a build removes what it was writing

    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop_on_sigterm_as_on_ctrl_c()
        with pytest.raises(typer.Exit) as exit_:
            command(json_out=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exit_.value.exit_code == 143 and cleaned == [True]
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"error": {"type": "Terminated", "message": "terminated (SIGTERM)"}}
    assert "terminated (SIGTERM)" in captured.err

    import weakref

    class Held:
        pass

    @friendly_errors
    def finishing(json_out: bool = False) -> None:  # the signal lands where Python drops what it raises
        held = Held()
        weakref.finalize(held, os.kill, os.getpid(), signal.SIGTERM)
        del held

    def exit_code(command: Callable[[], None]) -> int:
        try:
            stop_on_sigterm_as_on_ctrl_c()
            with pytest.raises(typer.Exit) as exit_:
                command()
        finally:
            signal.signal(signal.SIGTERM, previous)
        return exit_.value.exit_code

    assert exit_code(finishing) == 143  # before: the command finished as if no signal had come, exit 0

    class Named:
        def __set_name__(self, owner: type, name: str) -> None:
            os.kill(os.getpid(), signal.SIGTERM)

    @friendly_errors
    def importing(json_out: bool = False) -> None:  # Python wraps what __set_name__ raises in a RuntimeError
        type("Importing", (), {"attribute": Named()})

    assert exit_code(importing) == 143  # before: a RuntimeError's traceback, exit 1


def test_output_to_a_full_disk_is_one_line_not_a_traceback():
    for args in (["--version"], ["config", "show", "tiny-llama-fp8.yaml", "--json"]):
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, "-m", "kiln", *args], stdout=full, stderr=subprocess.PIPE,
                                  text=True, cwd=REPO, env=repo_env(), timeout=60)
        assert (done.returncode, done.stderr) == (2, "error: cannot write the output: No space left on device\n")


@pytest.mark.parametrize(("hit", "words"), [(True, "hit, 12.50 s of quantize and build saved"),
                                            (False, "miss (corrupt), 12.50 s of calibration saved")])
def test_the_summary_says_what_the_cache_saved(monkeypatch, capsys, hit, words):
    from kiln.pipeline import summary

    monkeypatch.setattr(summary, "print_plan", lambda result: None)
    summary.print_result({"cache": {"hit": hit, "reason": "hit" if hit else "corrupt"}, "build_seconds_saved": 12.5,
                          "engine_dir": "/e", "load_ms": 1.0})
    assert f"cache     {words}" in capsys.readouterr().out


def test_a_build_that_fell_back_to_none_says_it_is_unquantized_not_that_it_converged(monkeypatch, capsys):
    from kiln.pipeline import summary

    monkeypatch.setattr(summary, "print_plan", lambda result: None)
    quantization = {"format": "none", "fallback_from": "int4_awq, fp8", "converged": True,
                    "gate": {"passed": True, "ppl_increase": 0.0, "kl": 0.0, "top1_agreement": 1.0}}
    summary.print_result({"quantization": quantization, "cache": {"hit": False, "reason": "new"},
                          "engine_dir": "/e", "load_ms": 1.0})
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("quantize"))
    assert line == "quantize  none (fell back from int4_awq, fp8): unquantized (nothing to calibrate or gate)"


def test_text_with_square_brackets_is_printed_as_it_is(tmp_path):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    result = CliRunner().invoke(app, ["build", str(tmp_path / "run[old]" / "cfg.yaml"), "--dry-run"])
    assert result.exit_code == 2 and f"{tmp_path / 'run[old]' / 'cfg.yaml'}: config file not found" in result.stderr


def test_serving_a_config_says_why_it_builds_first_and_nothing_on_a_hit(tmp_path, monkeypatch, capsys):
    from kiln.pipeline.config import find_config
    from kiln.pipeline.serve_command import _config_target
    from kiln.runtime.options import RuntimeOptions

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    for expected in ("build     cache miss (new)", None):  # before: a build with no word of why (a corrupt entry)
        _config_target(find_config("tiny-llama-bf16"), RuntimeOptions(device="cpu"), backend=None, progress=False)
        err = capsys.readouterr().err
        assert expected in err if expected else "cache miss" not in err
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    bundled = find_config("tiny-llama-bf16")
    longer = tmp_path / "longer.yaml"  # another build of the same model: the miss names what differs from it
    longer.write_text(bundled.read_text().replace("../models", str(bundled.parent.parent / "models"))
                      .replace("max_num_tokens: 512", "max_num_tokens: 256"))
    planned = CliRunner().invoke(app, ["build", str(longer), "--dry-run"])
    assert re.search(r"cache miss \(new: entry [0-9a-f]{12} differs in build\.max_num_tokens\)", planned.stdout), \
        planned.stdout  # before: "new", which an upgrade of Kiln said too (toolchain.kiln_sources)


def test_uvicorns_trace_level_is_taken_as_debug_for_kilns_own_lines():
    import logging

    from kiln.pipeline.serve_command import log_to_stderr

    log_to_stderr("trace")  # vLLM's --uvicorn-log-level trace; the logger is restored after the test
    assert logging.getLogger("kiln").level == logging.DEBUG
