"""How `kiln loadtest` reads what a server sends: streamed output (reasoning and tool calls too), streams that end
unfinished, failures by status, a /metrics that went away, and text prompts counted by the server's /tokenize. The
servers are fakes (aiohttp's), each answering one way."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from kiln.pipeline.bench.loadtest import _check_fits_server, _print_server, print_report
from kiln.pipeline.bench.server_metrics import usage_after_run
from kiln.pipeline.bench.serving_clients import RequestResult, run_http, summarize_results
from kiln.pipeline.bench.serving_workload import WorkloadError, make_workload

CARD = {"id": "fake", "max_model_len": 700, "max_input_len": 100}


@asynccontextmanager
async def fake_server(chunks: Callable[[int], list[dict | str]], tokenize: int | None = None,
                      seen: list[dict] | None = None, loading: int = 0) -> AsyncIterator[str]:
    """A server whose n-th streamed answer is ``chunks(n)`` (a dict is an SSE chunk, a str a raw line) and whose
    /tokenize counts ``tokenize`` tokens (no such route where None); the bodies it was sent go to ``seen``; its
    first ``loading`` model lists answer 503, still loading, as Kiln's server does."""
    answered = 0
    listed = 0

    async def models(_: web.Request) -> web.Response:
        nonlocal listed
        listed += 1
        if listed <= loading:
            return web.json_response({"error": {"message": "the engine is still loading: retry after 1 s"}},
                                     status=503, headers={"Retry-After": "0"})
        return web.json_response({"data": [CARD]})

    async def stream(request: web.Request) -> web.StreamResponse:
        nonlocal answered
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks(answered):
            await asyncio.sleep(0.01)
            await response.write((chunk if isinstance(chunk, str) else f"data: {json.dumps(chunk)}\n\n").encode())
        answered += 1
        return response

    async def count(request: web.Request) -> web.Response:
        (seen if seen is not None else []).append(await request.json())
        return web.json_response({"count": tokenize, "max_model_len": 700, "tokens": []})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", stream)
    app.router.add_post("/v1/chat/completions", stream)
    if tokenize is not None:
        app.router.add_post("/tokenize", count)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def workload(requests: int, max_tokens: int, prompt: str = "Hi"):
    return make_workload(requests=requests, warmup=0, request_rate=math.inf, seed=0, max_tokens=max_tokens,
                         prompt=prompt)


def delta(**fields) -> dict:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def finish(tokens: int) -> list[dict | str]:
    return [{"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": tokens}}, "data: [DONE]\n\n"]


def test_reasoning_and_tool_call_deltas_are_output_so_the_first_token_is_the_first_thought():
    answer = [delta(role="assistant"), delta(reasoning="Let"), delta(reasoning_content=" me"),
              delta(tool_calls=[{"index": 0, "function": {"arguments": "{}"}}]), delta(content="Yes"), *finish(4)]

    async def run() -> dict:
        async with fake_server(lambda _: answer) as url:
            return await run_http(url, workload(1, 4), concurrency=1, chat=True)

    report = asyncio.run(run())
    assert report["succeeded"] == 1 and report["output_tokens"] == 4
    assert report["itl_ms"]["count"] == 4  # five pieces of output (the finish one of them): before, only two
    assert report["ttft_ms"]["p50"] < report["latency_ms"]["p50"] - 30  # before: the whole answer's latency


def test_a_stream_that_ends_before_its_finish_or_its_done_fails_and_adds_no_tokens():
    text = [{"choices": [{"index": 0, "text": "t", "finish_reason": None}]}] * 2
    answers = [text + finish(5), text, text + finish(5)[:-1]]  # whole; cut before a finish; no [DONE]

    async def run() -> dict:
        async with fake_server(lambda n: answers[n]) as url:
            return await run_http(url, workload(3, 5), concurrency=1)

    report = asyncio.run(run())
    assert (report["succeeded"], report["failed"], report["output_tokens"]) == (1, 2, 5)
    assert report["errors"] == {"the stream ended before a finish_reason": 1,
                                "the stream ended without data: [DONE]": 1}
    assert report["tokens_counted"] == "usage"  # before: "estimated", from the cut stream without usage


def test_an_odd_chunk_from_another_server_fails_its_request_not_the_load_test():
    text = [{"choices": [{"index": 0, "text": "t", "finish_reason": None}]}] * 2
    odd = [{"error": "plain string error"},  # TGI's error event
           "data: {not json}\n\n", {"choices": None, "usage": {"completion_tokens": "x"}}, {"choices": ["t"]}]
    answers = [text + finish(5), *([*text, chunk, *finish(5)] for chunk in odd)]

    async def run() -> dict:
        async with fake_server(lambda n: answers[n]) as url:
            return await run_http(url, workload(len(answers), 5), concurrency=1)

    report = asyncio.run(run())  # before: the client process died on the first of these, and the run with it
    assert (report["succeeded"], report["failed"]) == (2, 3) and report["output_tokens"] == 10
    assert "plain string error" in report["errors"] and any("no JSON object" in e for e in report["errors"])


def test_estimated_tokens_say_how_many_of_the_succeeded_requests_they_are():
    counted = RequestResult(status=200, ttft_s=0.1, latency_s=0.2, completion_tokens=4, events=4)
    estimated = RequestResult(status=200, ttft_s=0.1, latency_s=0.2, completion_tokens=4, events=4,
                              without_usage=True)
    assert summarize_results([counted, estimated], 1.0)["tokens_counted"].startswith("estimated for 1 of 2 requests")
    assert summarize_results([estimated], 1.0)["tokens_counted"].startswith("estimated: the server sent no usage")


def test_failures_are_reported_by_status_apart_from_the_successes(capsys):
    fine = RequestResult(status=200, ttft_s=0.1, latency_s=0.2, completion_tokens=4, events=4)
    report = summarize_results([fine, fine, RequestResult(status=200, error="generation failed"),
                                RequestResult(status=503, error="at capacity")], 1.0, url="u", model="m", clients=2)
    assert report["statuses"] == {"200": 3, "503": 1} and report["failed_statuses"] == {"200": 1, "503": 1}
    print_report(report)
    assert "2 failed, by HTTP status: {'200': 1, '503': 1}" in capsys.readouterr().out


def test_a_metrics_endpoint_gone_after_the_run_gives_null_figures_and_says_why(capsys):
    async def run() -> dict:
        async with fake_server(lambda _: []) as url:  # no /metrics at all: a 404
            return await usage_after_run(url, {"server_cpu_s": 1.0, "server_rss": 2.0**20}, 100, 0.001)

    server = asyncio.run(run())
    assert server["resident_memory"] is None and server["idle_after"] is None
    assert server["cpu_us_per_token"] == {"server": None, "clients": 10.0}
    assert server["server_metrics_unavailable"] == "GET /metrics failed: HTTP 404"
    _print_server(server)
    assert "after the run   not known: GET /metrics failed: HTTP 404" in capsys.readouterr().out


def test_text_prompts_are_counted_by_the_servers_tokenize_before_anything_is_sent():
    seen: list[dict] = []

    async def check(tokens: int | None, max_tokens: int, chat: bool = False) -> None:
        async with fake_server(lambda _: [], tokenize=tokens, seen=seen) as url:
            await _check_fits_server(url, None, CARD, workload(4, max_tokens, "a long story"), chat)

    with pytest.raises(WorkloadError, match="prompt has 150 tokens but the engine's max_input_len is 100"):
        asyncio.run(check(150, 8))
    assert seen == [{"model": "fake", "prompt": "a long story"}]  # one call for the four requests' one prompt
    with pytest.raises(WorkloadError, match=r"prompt \(90 tokens\) \+ max_tokens \(650\) = 740"):
        asyncio.run(check(90, 650, chat=True))
    assert seen[-1] == {"model": "fake", "messages": [{"role": "user", "content": "a long story"}]}
    asyncio.run(check(None, 650))  # no /tokenize: not counted, so only max_tokens is checked, and it fits
    with pytest.raises(WorkloadError, match=r"max_tokens \(700\) leaves no room for a prompt") as refused:
        asyncio.run(check(None, 700))
    assert "1 tokens" not in str(refused.value)  # before: "prompt (1 tokens) + max_tokens (700) = 701"


def test_a_server_still_loading_its_engine_is_waited_for_and_one_that_stays_so_named():
    from kiln.pipeline.bench.serving_clients import LoadTestError, _model_card, _session

    async def card(loading: int, ready_wait_s: float) -> dict:
        async with fake_server(lambda n: [], loading=loading) as url, _session(url, None, 1, 10) as session:
            return await _model_card(session, url, ready_wait_s)

    assert asyncio.run(card(loading=3, ready_wait_s=30)) == CARD  # as vLLM's bench waits for the server
    with pytest.raises(LoadTestError, match="503"):
        asyncio.run(card(loading=10**6, ready_wait_s=0.2))


def test_a_server_not_listening_yet_is_waited_for_saying_so_once():
    """`kiln serve ... & kiln loadtest URL`: the port opens once the engine is built and loading (it had ended the
    run at once with a refused connection)."""
    import socket

    from kiln.pipeline.bench.serving_clients import LoadTestError, _model_card, _session

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"  # nothing listens once it is closed
    told: list[str] = []

    async def card() -> dict:
        async with _session(url, None, 1, 10) as session:
            return await _model_card(session, url, 1.5, on_wait=told.append)

    started = time.monotonic()
    with pytest.raises(LoadTestError, match="cannot list models"):
        asyncio.run(card())
    assert time.monotonic() - started >= 1.4 and told == [f"waiting for {url} (nothing answers there yet), up to "
                                                          f"0.025 minutes"]


def test_server_cpu_per_token_counts_the_tokens_it_generated_for_clients_gone_mid_stream():
    """A soak run (`--disconnect`): the server's CPU went into every token generated, the delivered ones fewer (it had
    divided by those alone, 1.5x too high); a run that delivered none has no figure (it had shown CPU seconds)."""
    from kiln.pipeline.bench.server_metrics import server_usage

    before = {"server_cpu_s": 1.0, "engine_cpu_s": 2.0, "generated": 100.0, "server_rss": 1.0, "engine_rss": 1.0}
    after = {"server_cpu_s": 2.0, "engine_cpu_s": 5.0, "generated": 300.0}
    usage = server_usage(before, after, {**after, "server_rss": 1.0, "engine_rss": 1.0}, tokens=150, client_cpu_s=0.3)
    assert usage["cpu_us_per_token"] == {"server": 5000.0, "engine_process": 15000.0, "clients": 2000.0}
    nothing = server_usage(before, {**before}, before, tokens=0, client_cpu_s=0.3)["cpu_us_per_token"]
    assert nothing == {"server": None, "engine_process": None, "clients": None}
