"""`kiln loadtest` reports throughput and TTFT percentiles; the embedding example runs end to end."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import math
import resource
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from kiln.pipeline.bench.http_clients_process import run_http_apart
from kiln.pipeline.bench.loadtest import loadtest
from kiln.pipeline.bench.serving_clients import LoadTestError, RequestResult, run_http, run_offline, summarize_results
from kiln.pipeline.bench.serving_workload import (
    ServingRequest,
    ServingWorkload,
    WorkloadError,
    make_workload,
    with_fresh_token_ids,
)
from kiln.pipeline.serve_command import serve
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from tests.subprocess_env import REPO, repo_env
from tests.test_server_support import engine_idle, tiny_engine, wait_until


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny", api_key="k"))) as server:
        yield server


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(serve)
    app.command()(loadtest)
    return app


def workload(requests: int, max_tokens: int, **options) -> ServingWorkload:
    return make_workload(**{"requests": requests, "warmup": 0, "request_rate": math.inf, "seed": 0,
                            "max_tokens": max_tokens, **options})


def test_http_clients_count_every_token_and_report_latency_percentiles(server, llm):
    report = asyncio.run(run_http(server.url, workload(10, 5, prompt="Once upon a time"), concurrency=4,
                                  api_key="k"))
    assert report["succeeded"] == 10 and report["failed"] == 0 and report["statuses"] == {"200": 10}
    assert report["output_tokens"] == 50 and report["output_tokens_per_s"] > 0
    ttft = report["ttft_ms"]
    assert ttft["count"] == 10 and 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"]
    assert report["itl_ms"]["count"] > 0 and report["model"] == "tiny" and report["tokens_per_event"] >= 1
    assert report["tpot_ms"]["count"] == 10  # vLLM's TPOT: (latency - TTFT) / (tokens - 1), each request's
    assert report["tpot_ms"]["max"] <= report["latency_ms"]["max"] / 4
    wait_until(lambda: engine_idle(llm))


def test_clients_spread_over_processes_send_every_request_once_and_measure_from_one_start(server, llm):
    requests = workload(7, 3, input_len=4, vocab_size=100, warmup=2)
    report = asyncio.run(run_http_apart(server.url, requests, concurrency=4, chat=False, api_key="k", model="tiny",
                                        processes=2))
    assert report["succeeded"] == 7 and report["output_tokens"] == 21 and report["ttft_ms"]["count"] == 7
    assert report["client_processes"] == 2 and report["client_cpu_s"] > 0
    with pytest.raises(LoadTestError, match="none of 7 requests succeeded.*Incorrect API key"):
        asyncio.run(run_http_apart(server.url, requests, concurrency=4, chat=False, api_key="wrong", model="tiny",
                                   processes=2))
    wait_until(lambda: engine_idle(llm))


def test_http_clients_over_chat_use_the_chat_route_and_refuse_token_id_prompts(server):
    report = asyncio.run(run_http(server.url, workload(4, 3, prompt="Hi"), concurrency=2, chat=True, api_key="k"))
    assert report["succeeded"] == 4 and report["output_tokens"] == 12
    with pytest.raises(LoadTestError, match="random token prompts"):
        asyncio.run(run_http(server.url, workload(1, 1, input_len=4, vocab_size=10), concurrency=1, chat=True,
                             api_key="k"))


def test_http_clients_with_a_wrong_key_fail_clearly(server):
    with pytest.raises(LoadTestError, match="cannot list models"):
        asyncio.run(run_http(server.url, workload(1, 1), concurrency=1, api_key="wrong"))


def test_failed_requests_are_counted_by_status_and_their_commonest_errors_named():
    fine = RequestResult(status=200, ttft_s=0.1, latency_s=0.2, completion_tokens=4, events=4)
    report = summarize_results([fine, RequestResult(status=200, error="generation failed: engine stopped"),
                                RequestResult(status=200, error="generation failed: engine stopped"),
                                RequestResult(status=503, error="at capacity")], duration_s=1.0)
    assert report["failed"] == 3 and report["statuses"] == {"200": 3, "503": 1}
    assert report["errors"] == {"generation failed: engine stopped": 2, "at capacity": 1}


def test_random_prompts_follow_their_lengths_and_poisson_arrivals_their_rate():
    drawn = make_workload(requests=400, warmup=3, request_rate=50.0, seed=1, input_len=20, output_len=10,
                          spread=0.5, vocab_size=100)
    assert len(drawn.requests) == 400 and len(drawn.warmup) == 3 and drawn.uses_token_ids
    assert {len(r.prompt) for r in drawn.requests} <= set(range(10, 31)) and len({len(r.prompt) for r in
                                                                                 drawn.requests}) > 10
    assert all(0 <= t < 100 for r in drawn.requests for t in r.prompt)
    assert {r.max_tokens for r in drawn.requests} <= set(range(5, 16))
    gaps = [b - a for a, b in zip(drawn.arrivals_s, drawn.arrivals_s[1:], strict=False)]
    assert drawn.arrivals_s[0] == 0.0 and all(g >= 0 for g in gaps)
    assert 0.017 < sum(gaps) / len(gaps) < 0.023  # mean gap 1 / 50 s
    assert make_workload(requests=400, warmup=3, request_rate=50.0, seed=1, input_len=20, output_len=10,
                         spread=0.5, vocab_size=100) == drawn
    assert workload(5, 1).arrivals_s == [0.0] * 5  # an infinite rate: all at once
    leaving = make_workload(requests=400, warmup=3, request_rate=50.0, seed=1, input_len=20, output_len=10,
                            spread=0.5, vocab_size=100, disconnect=0.25)
    cut = [r.disconnect_after for r in leaving.requests if r.disconnect_after is not None]
    assert 70 < len(cut) < 130 and all(1 <= n < 15 for n in cut) and leaving.warmup == drawn.warmup
    with pytest.raises(WorkloadError, match="--vocab-size"):
        workload(1, 1, input_len=4)


def test_a_prompts_file_is_read_in_turn(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("first\n\nsecond\n")
    assert [r.prompt for r in workload(3, 2, prompts_file=text).requests] == ["first", "second", "first"]
    records = tmp_path / "p.jsonl"
    records.write_text('{"prompt": "a", "max_tokens": 7}\n{"prompt": [5, 6]}\n')
    assert [(r.prompt, r.max_tokens) for r in workload(2, 3, prompts_file=records).requests] == [("a", 7), ([5, 6], 3)]
    records.write_text('{"text": "a"}\n')
    with pytest.raises(WorkloadError, match="p.jsonl:1"):
        workload(1, 1, prompts_file=records)
    share_gpt = tmp_path / "sharegpt.json"  # vLLM's --dataset-name sharegpt file, pretty-printed
    share_gpt.write_text(json.dumps([{"id": "0", "conversations": [{"from": "human", "value": "Hi there"},
                                                                    {"from": "gpt", "value": "Hello"}]},
                                     {"id": "1", "conversations": [{"from": "human", "value": "no reply"}]},
                                     {"id": "2", "conversations": [{"from": "human", "value": "Bye"},
                                                                   {"from": "gpt", "value": "Bye!"}]}], indent=2))
    assert [r.prompt for r in workload(3, 4, prompts_file=share_gpt).requests] == ["Hi there", "Bye", "Hi there"]
    # before: sent line by line, "[" and "  {" among the prompts
    texts = tmp_path / "texts.JSON"
    texts.write_text('["one", "two"]')
    assert [r.prompt for r in workload(2, 4, prompts_file=texts).requests] == ["one", "two"]
    share_gpt.write_text(json.dumps([{"prompt": "a"}, {"text": "b"}]))
    with pytest.raises(WorkloadError, match=r"sharegpt.json:\[1\]"):
        workload(1, 1, prompts_file=share_gpt)


def test_spread_varies_a_text_prompts_output_lengths():
    lengths = {r.max_tokens for r in workload(40, 10, prompt="Hi", spread=0.5).requests}
    assert lengths <= set(range(5, 16)) and len(lengths) > 5


def test_a_fresh_draw_keeps_every_length_and_arrival_but_none_of_the_token_ids():
    drawn = make_workload(requests=20, warmup=2, request_rate=50.0, seed=0, input_len=16, output_len=8, spread=0.5,
                          vocab_size=1000, disconnect=0.5)
    fresh = with_fresh_token_ids(drawn, 1000, seed=7)
    assert fresh.arrivals_s == drawn.arrivals_s
    for old, new in zip(drawn.warmup + drawn.requests, fresh.warmup + fresh.requests, strict=True):
        assert (len(new.prompt), new.max_tokens, new.disconnect_after) == (len(old.prompt), old.max_tokens,
                                                                           old.disconnect_after)
        assert new.prompt != old.prompt and all(0 <= t < 1000 for t in new.prompt)


def test_the_offline_baseline_refills_each_slot_as_soon_as_its_request_finishes():
    finished, in_flight = [], [0, 0]  # now, most at once

    class SleepingLLM:  # a request takes a hundredth of a second per token
        async def generate_async(self, prompt, params):
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
            await asyncio.sleep(params.max_tokens / 100)
            in_flight[0] -= 1
            finished.append(params.max_tokens)
            return SimpleNamespace(token_ids=[1] * params.max_tokens)

    requests = ServingWorkload([ServingRequest("x", 30)] + [ServingRequest("x", 1)] * 8, [], [0.0] * 9)
    report = asyncio.run(run_offline(SleepingLLM(), requests, concurrency=2))
    # batches of two would hold the seven short requests after the first until the long one ends
    assert finished[-1] == 30 and in_flight[1] == 2
    assert report["requests"] == 9 and report["output_tokens"] == 38


def test_a_client_process_counts_its_cpu_from_the_start_of_the_measurement(server, monkeypatch):
    from kiln.pipeline.bench.http_clients_process import _run

    job = {"url": server.url, "chat": False, "api_key": "k", "model": "tiny", "concurrency": 2,
           "workload": workload(3, 2, prompt="Hi", warmup=1).to_json()}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    before = usage.ru_utime + usage.ru_stime  # this process's imports and engine load: seconds
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{time.time()}\n"))  # the start signal
    out = asyncio.run(_run(job))
    assert len(out["results"]) == 3 and 0 <= out["cpu_s"] < before


def test_loadtest_serves_an_engine_on_loopback_and_reports_its_efficiency_against_the_engine():
    # enough requests that each process's CPU time spans several of the kernel's 10 ms ticks, even on a busy machine
    result = CliRunner().invoke(cli(), ["loadtest", str(tiny_engine()), "--clients", "3", "--requests", "12",
                                        "--input-len", "8", "--output-len", "8", "--spread", "0.5", "--in-process",
                                        "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    served = report["output_tokens"]
    assert report["succeeded"] == 12 and report["url"].startswith("http://127.0.0.1:")
    assert report["workload"]["output_tokens_mean"] == round(served / 12, 1) and report["workload"]["prompt"] is None
    assert {key: report["workload"][key] for key in ("seed", "input_len", "spread")} == {
        "seed": 0, "input_len": 8, "spread": 0.5}  # what makes the run again
    assert report["run"]["started_at"] and report["run"]["python"]
    # the engine's own runs take the served requests' lengths (the spread drawn once), with fresh token ids
    assert report["offline"]["output_tokens"] == served and report["in_process"]["output_tokens"] == served
    cpu = report["server"]["cpu_us_per_token"]  # the engine runs in a process of its own, the clients in another
    assert set(cpu) == {"server", "engine_process", "clients"} and min(cpu.values()) > 0
    assert report["efficiency"] == pytest.approx(report["output_tokens_per_s"]
                                                 / report["offline"]["output_tokens_per_s"], abs=1e-4)


def test_loadtest_refuses_a_workload_the_engine_cannot_serve_before_loading_it(tmp_path, monkeypatch):
    from kiln.pipeline.serve_command import ServeTarget

    monkeypatch.setattr(ServeTarget, "loader", lambda *a: pytest.fail("the engine was loaded"))
    for options, problem in ((["--input-len", "100000"], "max_input_len"), (["--max-tokens", "100000"], "max_seq_len"),
                             (["--prompts-file", str(tmp_path / "missing.txt")], "missing.txt"),
                             (["--prompts-file", str(tmp_path / "p.txt"), "--spread", "0.5"], "leave out --spread"),
                             (["--request-rate", "0"], "above 0")):
        result = CliRunner().invoke(cli(), ["loadtest", str(tiny_engine()), *options])
        assert result.exit_code != 0 and problem in result.output, (options, result.output)


@pytest.mark.parametrize(("options", "problem"), [
    (["http://127.0.0.1:8000/v1"], "without a path (/v1)"),  # the OpenAI base URL, not the server's root
    (["http://127.0.0.1:port"], "not a server URL"),
    (["localhost:8000"], "starts with its scheme"),  # before: "no such engine directory or config"
    (["http://127.0.0.1:8000", "--input-len", "16", "--prompt", "hi"], "give one"),
    (["http://127.0.0.1:8000", "--chat", "--input-len", "16"], "--chat sends messages"),
    (["http://127.0.0.1:8000", "--in-process", "--device", "cuda"], "--in-process, --device apply only when"),
    (["http://127.0.0.1:8000", "--offline"], "--offline applies only when loadtest serves the engine itself"),
    (["http://127.0.0.1:8000", "--no-offline"], "--no-offline applies only when"),
    (["http://127.0.0.1:8000", "--vocab-size", "100"], "--vocab-size bounds the random token ids of --input-len"),
    (["http://127.0.0.1:8000", "--prompt", "hi", "--vocab-size", "100"], "give --input-len, or leave --vocab-size"),
])
def test_loadtest_refuses_a_bad_url_or_conflicting_workloads_in_one_line(options, problem):
    result = CliRunner().invoke(cli(), ["loadtest", *options])
    assert result.exit_code == 2 and problem in result.output and "Traceback" not in result.output, result.output


def test_a_running_servers_card_limits_the_workload_before_any_request_and_its_errors_are_read_as_messages():
    from kiln.pipeline.bench.serving_clients import error_message
    from kiln.pipeline.bench.serving_workload import card_limits, check_fits

    workload = make_workload(requests=2, warmup=0, request_rate=math.inf, seed=0, max_tokens=4, input_len=300,
                             vocab_size=100)
    with pytest.raises(WorkloadError, match="prompt has 300 tokens but the engine's max_input_len is 256"):
        check_fits(workload, card_limits({"id": "m", "max_model_len": 512, "max_input_len": 256}))
    with pytest.raises(WorkloadError, match="max_input_len is 199"):  # vLLM's card: the context less one token
        check_fits(workload, card_limits({"id": "m", "max_model_len": 200}))
    assert card_limits({"id": "m"}) is None
    refused = b'{"error": {"message": "This model\'s maximum context length is 512 tokens", "type": "x"}}'
    assert error_message(refused) == "This model's maximum context length is 512 tokens"
    assert error_message(b"<html>bad gateway</html>") == "<html>bad gateway</html>"


def test_time_per_output_token_is_vllms_after_the_first_token():
    from kiln.pipeline.bench.serving_clients import time_per_output_token

    assert time_per_output_token(RequestResult(status=200, ttft_s=0.1, latency_s=0.5, completion_tokens=5)) == 0.1
    assert time_per_output_token(RequestResult(status=200, ttft_s=0.1, latency_s=0.1, completion_tokens=1)) is None


def test_every_client_going_away_is_a_soak_not_a_failure_and_one_token_is_no_disconnect():
    gone = RequestResult(status=200, completion_tokens=3, events=3, disconnected=True)
    every_one_gone = summarize_results([gone, gone], duration_s=1.0)
    assert every_one_gone["disconnected"] == 2
    assert every_one_gone["ttft_ms"] == {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    counted = RequestResult(status=200, ttft_s=0.1, latency_s=0.2, completion_tokens=8, events=8, without_usage=True)
    assert summarize_results([counted], duration_s=1.0)["tokens_counted"].startswith("estimated")
    one_token = make_workload(requests=8, warmup=0, request_rate=math.inf, seed=0, max_tokens=1, disconnect=1.0)
    assert all(request.disconnect_after is None for request in one_token.requests)


def test_loadtest_at_a_finite_rate_gives_no_efficiency_as_the_arrivals_set_the_served_rate():
    result = CliRunner().invoke(cli(), ["loadtest", str(tiny_engine()), "--clients", "2", "--requests", "3",
                                        "--request-rate", "50", "--max-tokens", "2", "--no-engine-process", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["succeeded"] == 3 and report["offline"]["output_tokens"] == 6 and "efficiency" not in report
    assert set(report["server"]["cpu_us_per_token"]) == {"server", "clients"}  # the engine is on a server thread


def test_a_soak_with_clients_going_away_mid_stream_leaves_the_engine_idle_with_every_block_free():
    result = CliRunner().invoke(cli(), ["loadtest", str(tiny_engine()), "--clients", "4", "--requests", "12",
                                        "--input-len", "8", "--output-len", "40", "--disconnect", "0.5",
                                        "--no-offline", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    # the seeded draw picks 7 to leave; one whose tokens arrive in fewer events than its cut finishes instead
    assert 1 <= report["disconnected"] <= 7 and report["disconnected"] + report["succeeded"] == 12
    assert report["statuses"] == {"200": 12}
    server = report["server"]
    assert server["idle_after"] == {"running": 0, "waiting": 0, "kv_blocks_used": 0}
    assert set(server["resident_memory"]) == {"server", "engine_process"}
    assert all(m["after_mb"] > 0 for m in server["resident_memory"].values())


def test_serve_command_help_lists_its_options():
    result = CliRunner().invoke(cli(), ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in ("--host", "--port", "--api-key", "--max-queue", "--shutdown-timeout", "--engine-process"):
        assert option in result.output


def test_serve_refuses_an_empty_or_blank_api_key_rather_than_serving_without_one():
    for key in ("", "  "):  # --api-key "$(cat an-empty-secret-file)"
        result = CliRunner().invoke(cli(), ["serve", str(tiny_engine()), "--port", "0", "--api-key", key])
        assert result.exit_code == 2 and "blank" in result.output, (key, result.output)
    result = CliRunner().invoke(cli(), ["serve", str(tiny_engine()), "--port", "0"], env={"KILN_API_KEY": ""})
    assert result.exit_code == 2 and "blank" in result.output, result.output  # a Kubernetes secret left empty


def test_embedding_example_serves_an_app_and_a_worker_from_one_engine():
    proc = subprocess.run([sys.executable, "examples/embedded_service.py", str(tiny_engine()), "--self-test"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=repo_env())
    assert proc.returncode == 0, proc.stderr
    for route in ("/ask ->", "/ask/stream ->", "/summarize ->", "/engine ->"):
        assert route in proc.stdout
    assert "/summarize of a text too long -> 400" in proc.stdout and proc.stdout.count("worker ->") == 4


def test_embedding_example_worker_skips_a_job_its_caller_cancelled_and_answers_the_next(llm):
    spec = importlib.util.spec_from_file_location("embedded_service", REPO / "examples" / "embedded_service.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    worker = example.Worker(llm)
    try:
        worker.submit("a caller that gives up").cancel()  # as asyncio.wait_for's timeout or a cancelled handler does
        assert isinstance(worker.submit("the next caller").result(timeout=10), str)  # before: its thread had died
    finally:
        worker.close()


class _ReplayedStream:
    """A server's streamed answer, as aiohttp's session gives it: these SSE lines, one chunk each."""

    def __init__(self, chunks: list[dict]) -> None:
        self.status = 200
        self.content = self._lines([f"data: {json.dumps(chunk)}\n".encode() for chunk in chunks] + [b"data: [DONE]\n"])

    @staticmethod
    async def _lines(lines: list[bytes]):
        for line in lines:
            yield line

    def post(self, path: str, json: dict) -> _ReplayedStream:
        return self

    async def __aenter__(self) -> _ReplayedStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None


def test_streamed_usage_on_every_chunk_or_none_at_all_is_read_as_the_tokens_that_came():
    from kiln.pipeline.bench.serving_clients import _one_http_request

    def text(piece: str, finish: str | None = None, usage: int | None = None) -> dict:
        return {"choices": [{"index": 0, "text": piece, "finish_reason": finish}],
                **({"usage": {"completion_tokens": usage}} if usage is not None else {})}

    continuous = [text(f"t{i}", "length" if i == 3 else None, usage=i + 1) for i in range(4)]  # vLLM's continuous
    result = asyncio.run(_one_http_request(_ReplayedStream(continuous), "/v1/completions", {"max_tokens": 4}, None))
    assert (result.events, len(result.gaps_s), result.completion_tokens) == (4, 3, 4)  # before: no token counted
    # as output, so no inter-token gap and a time to first token of the whole answer
    stopped = [text(f"t{i}", "stop" if i == 4 else None) for i in range(5)]  # no usage, and EOS honoured anyway
    result = asyncio.run(_one_http_request(_ReplayedStream(stopped), "/v1/completions", {"max_tokens": 16}, None))
    assert (result.completion_tokens, result.without_usage) == (5, True)  # before: 16, max_tokens
    long = [text(f"t{i}", "length" if i == 3 else None) for i in range(4)]  # chunks of several tokens
    assert asyncio.run(_one_http_request(_ReplayedStream(long), "/v1/completions", {"max_tokens": 16},
                                         None)).completion_tokens == 16


def test_more_failures_than_max_failure_rate_allows_exit_3_after_the_report(llm):
    app = create_app(llm, tiny_engine(), ServerSettings(model_name="tiny", max_queue=1))
    with ServerThread(app) as full:  # 32 sent at once where the engine takes 16 and one more: 503s
        runs = [CliRunner().invoke(cli(), ["loadtest", full.url, "--clients", "32", "--requests", "32", "--warmup",
                                           "0", "--max-tokens", "48", "--json", *rate])
                for rate in ([], ["--max-failure-rate", "0"])]
    reported, gated = (json.loads(run.stdout[run.stdout.index("{"):run.stdout.rindex("}") + 1]) for run in runs)
    assert runs[0].exit_code == 0 and reported["failed"] > 0  # by default failures are reported, as vLLM's
    assert runs[1].exit_code == 3 and gated["failed"] > 0 and "more than --max-failure-rate 0" in runs[1].stderr
