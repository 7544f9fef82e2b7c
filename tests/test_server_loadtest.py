"""`kiln loadtest` reports throughput and TTFT percentiles; the embedding example runs end to end."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from kiln.pipeline.bench.loadtest import LoadTestError, loadtest, run_load
from kiln.pipeline.serve_command import serve
from kiln.runtime import LLM
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from tests.subprocess_env import REPO, repo_env
from tests.test_server_support import engine_idle, tiny_engine, wait_until


@pytest.fixture(scope="module")
def llm():
    with LLM.load(tiny_engine()) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny", api_key="k"))) as server:
        yield server


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(serve)
    app.command()(loadtest)
    return app


def test_run_load_counts_every_token_and_reports_ttft_percentiles(server, llm):
    report = asyncio.run(run_load(server.url, clients=4, requests=10, max_tokens=5, prompt="Once upon a time",
                                  api_key="k"))
    assert report["succeeded"] == 10 and report["failed"] == 0 and report["statuses"] == {"200": 10}
    assert report["output_tokens"] == 50 and report["output_tokens_per_s"] > 0
    assert report["ttft_ms"]["count"] == 10 and 0 < report["ttft_ms"]["p50"] <= report["ttft_ms"]["p99"]
    assert report["itl_ms"]["count"] > 0 and report["model"] == "tiny"
    wait_until(lambda: engine_idle(llm))


def test_run_load_over_chat_uses_the_chat_route(server):
    report = asyncio.run(run_load(server.url, clients=2, requests=4, max_tokens=3, prompt="Hi", chat=True,
                                  api_key="k"))
    assert report["succeeded"] == 4 and report["output_tokens"] == 12


def test_run_load_with_a_wrong_key_fails_clearly(server):
    with pytest.raises(LoadTestError, match="cannot list models"):
        asyncio.run(run_load(server.url, clients=1, requests=1, max_tokens=1, prompt="x", api_key="wrong"))


def test_loadtest_command_serves_an_engine_on_loopback_and_prints_json():
    result = CliRunner().invoke(cli(), ["loadtest", str(tiny_engine()), "--clients", "3", "--requests", "6",
                                        "--max-tokens", "4", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["succeeded"] == 6 and report["output_tokens"] == 24 and report["url"].startswith("http://127.0.0.1:")


def test_serve_command_help_lists_its_options():
    result = CliRunner().invoke(cli(), ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--host", "--port", "--api-key", "--max-queue", "--shutdown-timeout"):
        assert option in result.output


def test_embedding_example_serves_an_app_and_a_worker_from_one_engine():
    proc = subprocess.run([sys.executable, "examples/embedded_service.py", str(tiny_engine()), "--self-test"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=repo_env())
    assert proc.returncode == 0, proc.stderr
    for route in ("/ask ->", "/ask/stream ->", "/summarize ->", "/engine ->"):
        assert route in proc.stdout
    assert proc.stdout.count("worker ->") == 3
