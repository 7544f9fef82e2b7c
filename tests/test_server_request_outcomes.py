"""How /metrics counts a request's outcome under vLLM's finished_reason (a failure is an "error", a client gone or a
stopped engine an "abort"), and its name[] filter, as prometheus-client's own app serves it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import generate_latest

from kiln.runtime.errors import EngineClosedError
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.generation import Job
from kiln.runtime.server.metrics import ServerMetrics
from kiln.runtime.server.responding import StreamEvents, _collect, _sse
from kiln.runtime.structured_output import StructuredOutputError
from tests.test_server_support import tiny_engine

MODEL = "tiny"


class _FailingModel:
    """A served model whose every job ends with ``error`` before any output."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def generate(self, jobs, on_finished=None):
        async def batches():
            raise self.error
            yield

        return batches()

    async def generate_final(self, jobs, on_output, request_ids):
        raise self.error


class _StayingClient:
    """A request whose client stays until the answer is done."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}


def finished(metrics: ServerMetrics) -> dict[str, float]:
    prefix = "vllm:request_success_total{"
    return {line.split('finished_reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in generate_latest(metrics.registry).decode().splitlines() if line.startswith(prefix)}


def metrics_of(stats=lambda: None) -> ServerMetrics:
    return ServerMetrics(stats, lambda: {}, lambda: None, MODEL)


@pytest.mark.parametrize(("error", "reason"), [(StructuredOutputError("the format cannot go on"), "error"),
                                               (EngineClosedError("the server shut down"), "abort")])
def test_a_failed_request_counts_as_an_error_and_one_a_stopped_engine_ended_as_an_abort(error, reason):
    jobs = [Job([1, 2], SamplingParams(max_tokens=4)) for _ in range(2)]
    streamed, answered = metrics_of(), metrics_of()
    assert finished(streamed) == {"stop": 0, "length": 0, "abort": 0, "error": 0}  # every series from the start

    async def stream() -> bytes:
        events = StreamEvents(render=lambda index, delta: [], usage=lambda usage: {})
        return b"".join([piece async for piece in _sse(_FailingModel(error), jobs, streamed, [], events,
                                                      lambda: None, None, {})])

    assert b'"error"' in asyncio.run(stream())
    with pytest.raises(APIError):
        asyncio.run(_collect(_FailingModel(error), jobs, answered, _StayingClient(), None))
    for metrics in (streamed, answered):  # before: both reasons counted as aborts
        assert finished(metrics) == {"stop": 0, "length": 0, "abort": 0, "error": 0, reason: 2}


def test_metrics_name_filter_gives_only_the_samples_named(llm):
    names = ["vllm:num_requests_running", "vllm:request_success_total"]
    payload, _ = metrics_of(lambda: {"num_running": 3}).exposition("", names)
    samples = [line for line in payload.decode().splitlines() if not line.startswith("#")]
    assert {line.split("{")[0] for line in samples} == set(names) and len(samples) == 5  # 1 + 4 finished reasons
    assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 3.0' in samples
    with ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL))) as server:
        text = httpx.get(f"{server.url}/metrics", params={"name[]": "vllm:num_requests_running"}).text
    assert [line.split("{")[0] for line in text.splitlines() if not line.startswith("#")] == [names[0]]
