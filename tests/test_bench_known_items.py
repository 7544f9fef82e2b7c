"""`kiln bench` and `kiln loadtest` reports: the length check against the model's positions, the KV pool of a
tensor-parallel engine, the runtime options a run used, and a /metrics that failed after the warm-up."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from kiln.pipeline.bench import server_metrics
from kiln.pipeline.bench.loadtest import _measure, _print_server
from kiln.pipeline.bench.measure import kv_pool_report
from kiln.pipeline.bench.report import print_report
from kiln.pipeline.bench.server_metrics import MetricsUnavailableError, usage_after_run
from kiln.pipeline.config import load_config
from tests.test_bench import bench_json, run_bench, write_architecture
from tests.test_loadtest_reading import fake_server, finish
from tests.test_server_loadtest import cli as loadtest_cli
from tests.test_server_support import tiny_engine

TINY = ["--prompts", "2", "--input-len", "8", "--output-len", "3", "--batch-1"]


@pytest.fixture(autouse=True)
def kiln_env(tmp_path_factory, monkeypatch) -> None:
    """test_bench's engine cache (its builds are hits here), and no KILN_* runtime setting from the caller's shell."""
    for name in [n for n in os.environ if n.startswith("KILN_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KILN_CACHE", str(tmp_path_factory.getbasetemp() / "bench-cache"))


def test_a_run_as_long_as_the_models_positions_is_benchmarked_and_one_token_longer_is_refused(tmp_path):
    arch = write_architecture(tmp_path / "positions-250.json", max_position_embeddings=250)  # not whole blocks of 32
    code, _, err = run_bench(str(arch), "--prompts", "1", "--input-len", "245", "--output-len", "6")
    assert code == 2 and "245 + --output-len 6 exceeds the architecture's max_position_embeddings (250)" in err
    report = bench_json(str(arch), "--prompts", "1", "--input-len", "244", "--output-len", "6", "--batch-1")
    assert report["kiln"]["decode_tokens_per_s_batch1"] > 0  # before: refused, 250 rounded up to 256 positions
    assert load_config(Path(report["config"])).config.build.max_seq_len == 250


def fake_llm(ranks: int) -> SimpleNamespace:
    """An engine whose rank 0 holds 2 layers of K and V, 4 blocks of 16 tokens of one bf16 KV head of 8."""
    layer = (torch.zeros(4, 16, 1, 8, dtype=torch.bfloat16),) * 2
    runner = SimpleNamespace(kv_caches=[layer, layer], device=torch.device("cpu"),
                             tp=SimpleNamespace(size=ranks) if ranks > 1 else None)
    return SimpleNamespace(stats=lambda: {"kv_cache": {"num_blocks": 4, "block_size": 16}},
                           limits=SimpleNamespace(max_seq_len=32, max_batch_size=2),
                           engine=SimpleNamespace(model_runner=runner))


def test_a_tensor_parallel_kv_pool_counts_the_bytes_of_every_rank_and_names_one_ranks_share():
    rank_bytes = 2 * 2 * 4 * 16 * 8 * 2  # layers, K and V, blocks, tokens, head dims, bf16
    assert kv_pool_report(fake_llm(1)) == {
        "blocks": 4, "tokens": 64, "full_length_sequences": 2, "max_batch_size": 2, "bytes": rank_bytes,
        "bytes_per_rank": rank_bytes, "ranks": 1}
    pool = kv_pool_report(fake_llm(2))
    assert (pool["bytes"], pool["bytes_per_rank"], pool["ranks"], pool["tokens"]) == (2 * rank_bytes, rank_bytes, 2, 64)


def test_every_bench_and_served_loadtest_report_records_the_kiln_runtime_settings(monkeypatch, capsys):
    monkeypatch.setenv("KILN_SCHEDULER_POLICY", "guaranteed_no_evict")
    monkeypatch.setenv("KILN_PREFIX_CACHING", "0")
    expected = {"scheduler_policy": "guaranteed_no_evict", "prefix_caching": False}
    report = bench_json("tiny-llama-bf16.yaml", *TINY)
    assert report["runtime"] == expected  # before: only under --suite
    print_report(report)
    assert "runtime: scheduler_policy guaranteed_no_evict, prefix_caching False" in capsys.readouterr().out
    result = CliRunner().invoke(loadtest_cli(), ["loadtest", str(tiny_engine()), "--clients", "1", "--requests", "2",
                                                 "--max-tokens", "2", "--warmup", "0", "--no-offline",
                                                 "--no-engine-process", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["runtime"] == expected
    monkeypatch.delenv("KILN_SCHEDULER_POLICY")
    monkeypatch.delenv("KILN_PREFIX_CACHING")
    assert bench_json("tiny-llama-bf16.yaml", *TINY)["runtime"] == {}  # the defaults


def test_a_metrics_endpoint_failing_after_the_warm_up_keeps_the_server_block_and_says_why(capsys):
    options = {"requests": 1, "warmup": 0, "request_rate": math.inf, "seed": 0, "prompt": "Hi", "max_tokens": 2,
               "input_len": None, "output_len": None, "spread": 0.0, "prompts_file": None, "disconnect": 0.0}

    async def run() -> dict:
        async with fake_server(lambda _: finish(2)) as url:  # no /metrics: a 404 after the warm-up and the run
            return await _measure(url, None, None, options, concurrency=1, chat=False, vocab_size=None,
                                  offline=False, in_process=False)

    server = asyncio.run(run())["server"]  # before: no server block at all
    assert server["server_metrics_unavailable"] == ("GET /metrics failed: HTTP 404 after the warm-up; "
                                                    "GET /metrics failed: HTTP 404 after the run")
    assert server["idle_after"] is None and set(server["cpu_us_per_token"]) == {"clients"}
    _print_server(server)
    assert "after the run   not known: GET /metrics failed: HTTP 404 after the warm-up" in capsys.readouterr().out


def test_what_metrics_says_after_the_run_is_kept_when_the_scrape_after_the_warm_up_failed(monkeypatch, capsys):
    async def scrape(_: str) -> dict[str, float]:
        return {"server_cpu_s": 9.0, "server_rss": 2.0**20, "running": 0, "waiting": 0, "kv_blocks_used": 0}

    monkeypatch.setattr(server_metrics, "scrape", scrape)
    server = asyncio.run(usage_after_run("http://x", MetricsUnavailableError("GET /metrics failed: HTTP 503"), 100,
                                         0.001))
    assert server == {"cpu_us_per_token": {"server": None, "clients": 10.0}, "resident_memory": None,
                      "idle_after": {"running": 0, "waiting": 0, "kv_blocks_used": 0},
                      "server_metrics_unavailable": "GET /metrics failed: HTTP 503 after the warm-up"}
    _print_server(server)
    out = capsys.readouterr().out
    assert "not read: GET /metrics failed: HTTP 503 after the warm-up" in out and "0 KV blocks held" in out
