"""A served tensor-parallel engine's /metrics counts the CPU time and memory of its worker processes (rank 1 up), in
the engine's own process or in the server's, and `kiln loadtest`'s reading of /metrics includes them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from kiln.pipeline.bench.server_metrics import scrape
from kiln.runtime import LLM, RuntimeOptions
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from tests.test_tensor_parallel import _worker_pids, tp2_engine


def _cpu_seconds(pid: int) -> float:
    """The user and system CPU seconds of ``pid`` so far, read from /proc as prometheus_client reads them."""
    parts = Path(f"/proc/{pid}/stat").read_bytes().split(b")")[-1].split()
    return (float(parts[11]) + float(parts[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine_process"])
def test_metrics_report_each_local_tp_workers_cpu_seconds_and_memory_by_rank(tmp_path, engine_process):
    engine = tp2_engine(tmp_path)
    llm = LLM.load(engine, RuntimeOptions(engine_process=engine_process))
    (worker,) = _worker_pids(engine)
    with ServerThread(create_app(llm, engine, ServerSettings(model_name="tiny"))) as server:
        series = dict(line.rsplit(" ", 1) for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                      if line.startswith("kiln_engine_worker_process_"))
        cpu_s, rss = float(series['kiln_engine_worker_process_cpu_seconds_total{rank="1"}']), \
            float(series['kiln_engine_worker_process_resident_memory_bytes{rank="1"}'])
        assert 0 < cpu_s <= _cpu_seconds(worker) + 0.01 and rss > 2**20  # the worker's (to a tick): torch and a shard
        assert all('rank="1"' in name for name in series)  # rank 0 is the server's or the engine's process
        found = asyncio.run(scrape(server.url))
    assert found["workers_cpu_s"] >= cpu_s and found["workers_rss"] > 2**20
