"""The server through the official openai client on loopback: completions, chat, streaming, many concurrent streams,
clients that disconnect, and /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kiln.runtime.chat_template import ChatTemplate
from kiln.runtime.errors import EngineClosedError
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from tests.test_server_support import engine_idle, tiny_engine, wait_until

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(llm):
    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL, max_queue=256))
    with ServerThread(app) as server:
        yield server


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_completion_returns_text_usage_and_length_finish(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_greedy_completion_matches_the_embedded_runtime(client, llm):
    from kiln.runtime import SamplingParams

    expected = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected.text


def test_min_p_one_samples_what_greedy_decoding_picks(client):
    def ask(**sampling):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, seed=5,
                                         **sampling).choices[0].text

    assert ask(temperature=2.0, extra_body={"min_p": 1.0, "ignore_eos": True}) == ask(
        temperature=0, extra_body={"ignore_eos": True})


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_choices(client):
    def ask():
        return client.completions.create(model=MODEL, prompt="The cat", max_tokens=8, temperature=1.0, seed=1234, n=3,
                                         extra_body={"ignore_eos": True})

    first, second = ask(), ask()
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 24


def test_a_signed_seed_is_taken_modulo_2_64_and_choice_i_samples_with_seed_plus_i(client):
    def texts(seed: int, n: int) -> list[str]:
        out = client.completions.create(model=MODEL, prompt="The cat", max_tokens=24, temperature=1.0, seed=seed,
                                        n=n, extra_body={"ignore_eos": True})
        return [c.text for c in out.choices]

    minus_three = texts(-3, 2)
    assert minus_three == texts(-3, 2)
    assert minus_three[1] == texts(-2, 1)[0]  # 2**64 - 2 either way
    assert texts(-1, 1) != texts(-1, 1)  # -1 is no seed, as in vLLM


def test_batched_prompts_and_token_id_prompts_are_accepted(client):
    out = client.completions.create(model=MODEL, prompt=["One", "Two"], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert len(out.choices) == 2 and out.usage.completion_tokens == 6
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[3:6]
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                    stop=[f"never written {i}" for i in range(8)] + [stop],  # more than OpenAI's 4
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == stop  # vLLM's extension
    assert out.choices[0].text == full[:full.index(stop)]
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    said = client.chat.completions.create(**chat).choices[0].message.content
    last = list(client.chat.completions.create(**chat, stream=True, stop=[said[4:7]]))[-1].choices[0]
    assert last.finish_reason == "stop" and last.stop_reason == said[4:7]


def test_chat_completion_uses_the_chat_template(client, llm):
    from kiln.runtime import SamplingParams

    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                         max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    prompt = ChatTemplate.from_dir(tiny_engine()).render([{"role": "user", "content": "Hi there"}])
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_an_assistant_message_passed_back_as_the_clients_model_dump_is_accepted(client):
    messages = [{"role": "user", "content": "Hi there"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3).choices[0].message
    history = [*messages, answer.model_dump(), {"role": "user", "content": "And then?"}]
    assert {"annotations", "audio", "function_call", "refusal"} <= history[1].keys()  # each None
    assert client.chat.completions.create(model=MODEL, messages=history, max_tokens=2).choices[0].finish_reason


def test_streamed_completion_concatenates_to_the_unstreamed_text(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_streamed_chat_starts_with_the_role_and_ends_with_usage(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_streamed_chats_role_chunk_comes_with_its_first_token(server, llm, monkeypatch):
    """Benchmark clients (vLLM's bench serve) time the first token from the first chunk with choices."""
    step, steps_done = llm.engine.step, []

    def slow_step():
        if not steps_done:
            time.sleep(0.3)
        outputs = step()
        steps_done.append(True)
        return outputs

    monkeypatch.setattr(llm.engine, "step", slow_step)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http, http.stream("POST", "/v1/chat/completions",
                                                                            json=body) as response:
        first = json.loads(next(line for line in response.iter_lines() if line.startswith("data: "))[6:])
        assert first["choices"][0]["delta"]["role"] == "assistant" and steps_done
    wait_until(lambda: engine_idle(llm))


def test_every_step_of_a_stream_is_a_chunk_though_its_token_adds_no_text(client):
    kwargs = dict(model=MODEL, max_tokens=4, stream=True, extra_body={"ignore_eos": True},
                  logit_bias={"1": 100})  # </s> every step: special, so no text
    completion = [c for c in client.completions.create(prompt="Hi", **kwargs) if c.choices]
    assert len(completion) == 4 and "".join(c.choices[0].text for c in completion) == ""
    chat = [c for c in client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kwargs)
            if c.choices]
    assert len(chat) == 1 + 4 and chat[0].choices[0].delta.role == "assistant"  # the role, then a chunk a step


def raw_chunks(server, path: str, body: dict) -> tuple[bytes, list[dict]]:
    """A stream's raw bytes and its chunks (``[DONE]`` left out)."""
    raw = httpx.post(f"{server.url}{path}", json={"model": MODEL, "stream": True, **body}, timeout=30).content
    return raw, [json.loads(line[6:]) for line in raw.decode().splitlines()
                 if line.startswith("data: ") and line != "data: [DONE]"]


def test_streamed_chunks_are_raw_utf8_and_carry_usage_only_when_asked(server):
    text = "本 🙂"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20,
            "structured_outputs": {"choice": [text]}}
    raw, chunks = raw_chunks(server, "/v1/chat/completions", chat)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert b"\\u" not in raw and all("usage" not in c for c in chunks)  # before: "\\u672c", and "usage":null
    raw, chunks = raw_chunks(server, "/v1/completions", {"prompt": text, "echo": True, "max_tokens": 2})
    assert text.encode() in raw and all("usage" not in c for c in chunks)
    _, chunks = raw_chunks(server, "/v1/completions", {"prompt": text, "max_tokens": 2,
                                                       "stream_options": {"include_usage": True}})
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)  # as OpenAI sends them
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    prompt_tokens = chunks[-1].usage.prompt_tokens
    for index in (0, 1):
        usage = [c.usage for c in chunks if c.choices and c.choices[0].index == index]
        assert {u.prompt_tokens for u in usage} == {prompt_tokens}
        counts = [u.completion_tokens for u in usage]
        assert counts[0] == 0 and counts[-1] == 5  # the role chunk counts none (as vLLM's), the last chunk all
        assert all(earlier < later for earlier, later in zip(counts, counts[1:], strict=False))  # vLLM's test asks
        assert all(u.total_tokens == prompt_tokens + u.completion_tokens for u in usage)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_models_lists_the_served_model_with_the_limits_a_client_budgets_prompts_by(client, llm):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.max_model_len == llm.limits.max_request_tokens
    assert (card.root, card.parent) == (MODEL, None)  # vLLM's fields: the model served, no base model
    assert card.permission[0]["object"] == "model_permission" and card.permission[0]["allow_logprobs"]
    assert card.max_input_len == llm.limits.max_input_len < card.max_model_len  # longer prompts are refused
    with pytest.raises(openai.BadRequestError, match="max_input_len"):
        client.completions.create(model=MODEL, prompt=[5] * (card.max_input_len + 1), max_tokens=1)
    assert client.completions.create(model=MODEL, prompt=[5] * card.max_input_len, max_tokens=1).choices


def test_200_concurrent_streams_all_complete_and_free_every_block(server, llm):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=3, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        tokens, finish = 0, None
        async for chunk in stream:
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return tokens, finish

    async def main() -> list[tuple[int, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(main())
    assert results == [(3, "length")] * 200
    wait_until(lambda: engine_idle(llm))


def test_client_disconnecting_mid_stream_aborts_its_request_and_frees_its_blocks(server, llm, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="kiln.server")
    step = llm.engine.step

    def slow_step():  # 180 tokens take over a second, so the request is surely still running at the disconnect
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    aborted_before = llm.stats()["requests_finished"]["abort"]
    counted = ('kiln_requests_total{endpoint="/v1/completions",status="499"}',
               f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}}')
    tokens = (f'vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}}',
              f'vllm:generation_tokens_total{{engine="0",model_name="{MODEL}"}}')
    counts_before, tokens_before = metric_values(server, counted), metric_values(server, tokens)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 180, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=30) as http, http.stream("POST", "/v1/completions",
                                                                            json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: dropping the iterator closes the connection (a disconnect)
        next(line for line in lines if line.startswith("data: "))
        wait_until(lambda: metric_values(server, tokens)[1] > tokens_before[1])  # counted while it runs, as vLLM's
        assert llm.stats()["num_running"] == 1
    wait_until(lambda: engine_idle(llm))
    assert llm.stats()["requests_finished"]["abort"] == aborted_before + 1
    wait_until(lambda: metric_values(server, counted) == [n + 1 for n in counts_before])  # 499, and vLLM's abort
    prompt_tokens, generation_tokens = (n - before for n, before in zip(metric_values(server, tokens), tokens_before,
                                                                        strict=True))
    assert prompt_tokens == len(llm.tokenizer.encode("Once upon a time")) and 1 <= generation_tokens < 180
    assert "aborted: the client went away mid-stream" in caplog.text  # a request id's log tells what happened


def test_a_client_gone_before_its_first_token_is_logged_as_gone_before_it_not_mid_stream(server, llm, monkeypatch,
                                                                                         caplog):
    caplog.set_level(logging.INFO, logger="kiln.server")
    step, resume = llm.engine.step, threading.Event()

    def held_step():  # no token until the client has gone
        resume.wait(30)
        return step()

    monkeypatch.setattr(llm.engine, "step", held_step)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http, http.stream("POST", "/v1/completions",
                                                                                json=body) as response:
            assert response.status_code == 200  # the stream's head goes out at once; its first token never came
        wait_until(lambda: "aborted: the client went away" in caplog.text)
    finally:
        resume.set()
    # before: "mid-stream", though no token had come
    assert "aborted: the client went away before the first token (queued, or in prefill)" in caplog.text
    wait_until(lambda: engine_idle(llm))


def metric_values(server, names: tuple[str, ...]) -> list[float]:
    """The values of these samples (label sets as exposed) in the server's /metrics, 0 for one not there yet."""
    lines = httpx.get(f"{server.url}/metrics").text.splitlines()
    return [next((float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " ")), 0.0)
            for name in names]


def test_client_giving_up_on_a_non_streamed_request_aborts_all_its_choices(server, llm, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="kiln.server")
    step, abort = llm.engine.step, llm.abort
    started, aborts = threading.Event(), []

    def held_step():  # no choice can finish before the server has aborted all 16: this test does not race the engine
        started.set()
        deadline = time.monotonic() + 30
        while len(aborts) < 16 and time.monotonic() < deadline:
            time.sleep(0.005)
        return step()

    def counted_abort(request_id):
        aborts.append(request_id)
        abort(request_id)

    monkeypatch.setattr(llm.engine, "step", held_step)
    monkeypatch.setattr(llm, "abort", counted_abort)
    aborted_before = llm.stats()["requests_finished"]["abort"]
    counted = (f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}}',
               f'vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}}')
    counts_before = metric_values(server, counted)
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 240, "n": 16, "ignore_eos": True}).encode()
    url = httpx.URL(server.url)
    with socket.create_connection((url.host, url.port)) as client:  # a client that sends the request, then goes
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert started.wait(30)
    wait_until(lambda: engine_idle(llm))
    assert len(aborts) == 16
    assert llm.stats()["requests_finished"]["abort"] == aborted_before + 16
    assert 'status="499"' in httpx.get(f"{server.url}/metrics").text
    wait_until(lambda: "aborted: the client went away before the answer was done" in caplog.text)
    prompt = len(llm.tokenizer.encode("Hi"))  # each choice's prompt, counted by the engine with its first token
    wait_until(lambda: metric_values(server, counted) == [counts_before[0] + 16, counts_before[1] + 16 * prompt])


def test_a_non_streamed_request_the_engine_ends_with_an_error_is_counted_as_aborted(server, llm, monkeypatch):
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (time.sleep(0.01), step())[1])  # 240 tokens: over 2 s
    counted = (f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}}',)
    counts_before = metric_values(server, counted)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 240, "n": 3, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        response = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=30)
        wait_until(lambda: llm.stats()["num_running"] == 3)
        llm.abort_all(EngineClosedError("the server shut down before this request finished"))  # as a shutdown does
        assert response.result().status_code == 503
    wait_until(lambda: engine_idle(llm))
    assert metric_values(server, counted) == [counts_before[0] + 3]


def test_metrics_expose_requests_latencies_queue_and_kv_blocks(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello"},
               headers={"Authorization": f"Bearer {client.api_key}"})
    httpx.get(f"{server.url}/nowhere")
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("kiln_requests_total{endpoint=\"/v1/completions\",status=\"200\"}",
                 'kiln_requests_total{endpoint="/tokenize",status="200"}',
                 'kiln_requests_total{endpoint="other",status="404"}',
                 "kiln_time_to_first_token_seconds_bucket", "kiln_inter_token_latency_seconds_bucket",
                 "kiln_queue_depth", "kiln_running_requests", "kiln_kv_blocks_used", "kiln_kv_blocks_free",
                 "kiln_prefix_cache_hit_rate", "kiln_engine_load_seconds", "kiln_cuda_graphs_pending 0.0",
                 'kiln_engine_step_seconds_total{kind="decode",part="execute"}', "kiln_engine_steps_queued_ahead_total",
                 'kiln_engine_step_seconds_total{kind="prefill",part="host"}'):
        assert name in text, name


def test_health_is_ok_once_the_engine_is_loaded(server):
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_every_response_carries_a_request_id_the_client_reads(server, client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert raw.headers["x-request-id"].startswith("req_") and raw.parse()._request_id == raw.headers["x-request-id"]
    with client.completions.with_streaming_response.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True) as r:
        assert r.headers["x-request-id"].startswith("req_") and r.headers["x-request-id"] != raw.headers["x-request-id"]
    assert httpx.get(f"{server.url}/health", headers={"X-Request-Id": "trace-42"}).headers["x-request-id"] == "trace-42"
    assert httpx.get(f"{server.url}/health", headers={"X-Request-Id": "a b"}).headers["x-request-id"].startswith("req_")
    traced = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                            extra_headers={"X-Request-Id": "trace-42"})
    assert traced.id == "chatcmpl-trace-42"  # as vLLM names it, so logs and traces match
    named = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1,
                                                         extra_body={"request_id": "job-7"})
    assert named.parse().id == "cmpl-job-7"  # vLLM's request_id field
    assert named.headers["x-request-id"] == "job-7"  # and the id its log lines and engine ids carry (they had not)
    refused = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10**6, "request_id": "job-9"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "job-9"  # its errors too
    both = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"request_id": "job-8"},
                                     extra_headers={"X-Request-Id": "trace-8"})
    assert both.id == "cmpl-trace-8"  # the header first, as vLLM's _base_request_id reads them
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).id.startswith("cmpl-")
