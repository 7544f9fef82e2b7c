"""Bad input gets OpenAI-style 400s naming the field, a wrong key 401, a full queue 503 with Retry-After, and
/health tells loading, ready and failed apart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest

from kiln.runtime import LLM, KilnError
from kiln.runtime.server import ServerSettings, ServerStartError, ServerThread, create_app, run_server
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.foreign_fields import FOREIGN_FIELDS, RESPONSES_FOREIGN_FIELDS
from kiln.runtime.server.generation import Admission
from kiln.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from kiln.runtime.server.responses_protocol import ResponsesRequest
from tests.test_server_support import engine_idle, tiny_engine, wait_until

MODEL = "tiny"
LONG_TEXT = "word " * 200  # well over the test engine's max_input_len of 64 tokens


@pytest.fixture(scope="module")
def http(llm):
    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL))
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        yield http


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if 400 <= status < 500:  # the caller's mistake, whatever the status
        assert error["type"] == "invalid_request_error", error
    for word in words:
        assert word in error["message"], error["message"]
    return error


def test_a_streamed_prompt_logprobs_of_0_is_taken_as_vllm_takes_it(http):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        response = http.post(path, json={**body, "max_tokens": 2, "stream": True, "prompt_logprobs": 0})
        assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]"), response.text


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens", ["integer"]),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", ["max_tokens 0 generates nothing: with echo: true"]),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens", ["greater than or equal to 0"]),
    ({"prompt": "hi", "max_tokens": 100_000}, "max_tokens", ["maximum context length", "leaves room for at most"]),
    ({"prompt": ""}, "prompt", ["empty after tokenization"]),  # the tiny tokenizer adds no BOS
    ({"prompt": []}, "prompt", ["non-empty"]),
    ({"prompt": [3, -1]}, "prompt", ["token ids are >= 0, got -1"]),
    ({"prompt": [[3], []]}, "prompt", ["entry 1 is an empty token-id list"]),
    ({"prompt": [[3], "a"]}, "prompt", ["mixes strings, token ids and token-id lists"]),
    ({"prompt": [3, 1.5]}, "prompt", ["token ids are integers, got 1.5"]),
    ({"prompt": LONG_TEXT}, "prompt", ["max_input_len"]),
    ({"prompt": [5, 999_999]}, "prompt", ["999999"]),
    ({"max_tokens": 5}, "prompt", ["required"]),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", ["number"]),
    ({"prompt": "hi", "temperature": 3}, "temperature", ["less than or equal to 2"]),
    ({"prompt": "hi", "stream": "yes"}, "stream", ["boolean"]),
    ({"prompt": "hi", "stop": [""]}, "stop", ["non-empty"]),
    ({"prompt": "hi", "stop": [str(i) for i in range(65)]}, "stop", ["at most 64"]),
    ({"prompt": "hi", "n": 0}, "n", ["greater than or equal to 1"]),
    ({"prompt": "hi", "tools": []}, "tools", ["Unrecognized request argument"]),
    ({"prompt": "hi", "evil[X": 1}, "evil[X", ["Unrecognized request argument supplied: evil[X"]),  # before: "must
    # be a JSON object, not int"
    ({"prompt": "hi", "max_new_tokens": 4}, "max_new_tokens", ["Unrecognized request argument supplied: "
                                                               "max_new_tokens; send max_tokens instead"]),
    ({"prompt": "hi", "no_stop_trim": True}, "no_stop_trim", ["send include_stop_str_in_output: true"]),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ["-1", "at least 1"]),
    ({"prompt": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", ["greater than or equal to -1"]),
    ({"prompt": "hi", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens", ["more than the model's context"]),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", ["less than or equal to 20"]),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", ["less than or equal to 2"]),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", ["token ids"]),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", ["[-100, 100]"]),
    ({"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias", ["999999", "outside this model's vocabulary"]),
    ({"prompt": "hi", "stop_token_ids": [2, 999999]}, "stop_token_ids", ["999999", "vocabulary"]),
    ({"prompt": "hi", "stop_token_ids": [2] * 1025}, "stop_token_ids", ["1024"]),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", ["only allowed with stream"]),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens", ["min_tokens", "max_tokens=4"]),
    ({"prompt": "hi", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs", ["not available with stream"]),
    ({"prompt": "hi", "ignore_eos": True, "structured_outputs": {"choice": ["a"]}}, "ignore_eos",
     ["structured output"]),
    ({"prompt": "hi", "best_of": 2}, "best_of", ["not supported", "send null or 1"]),  # JSON, not Python, spellings
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of", ["3 is not supported", "send null or 2 (n)"]),
    ({"prompt": "hi", "use_beam_search": True}, "use_beam_search", ["not supported", "send null or false"]),
    ({"prompt": "hi", "length_penalty": 0.5}, "length_penalty", ["not supported", "1.0"]),
    ({"prompt": "hi", "add_special_tokens": "no"}, "add_special_tokens", ["valid boolean"]),
    ({"prompt": "hi", "allowed_token_ids": [5, 999999]}, "allowed_token_ids", ["999999", "outside this model's "
                                                                                "vocabulary"]),
    ({"prompt": ["hi"] * 4, "allowed_token_ids": [5] * 70_000}, "allowed_token_ids",  # each prompt would copy them
     ["70000 token ids, more than this model's vocabulary"]),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", ["at least 1"]),
    ({"prompt": "hi", "best_of": 1, "n": 2}, "best_of", ["best_of (1) must be greater than or equal to n (2)"]),
])
def test_bad_completion_requests_get_a_400_naming_the_field(http, body, param, words):
    error = assert_error(http.post("/v1/completions", json=body), 400, param, *words)
    assert error["type"] == "invalid_request_error"
    too_long = "maximum context length" in error["message"]  # the words and code clients match, as OpenAI's
    assert (error["code"] == "context_length_exceeded") == too_long and too_long == ("max_input_len" in words or
                                                                                    "maximum context length" in words)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": []}, "messages", ["at least 1"]),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", ["'user'"]),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", ["string"]),
    ({"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages", ["max_input_len"]),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100_000}, "max_completion_tokens",
     ["leaves room"]),
    ({"messages": [{"role": "assistant", "content": "hi"}], "continue_final_message": True},
     "continue_final_message", ["add_generation_prompt: false"]),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False,
      "continue_final_message": True}, "continue_final_message", ["must be the assistant's, not the user's"]),
    ({"messages": [{"role": "user", "content": "hi"}], "bad_words": ["x"]}, "bad_words", ["not supported", "[]"]),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": 5}, "tool_choice", ["'none', 'auto'"]),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "allowed_tools"}},
     "tool_choice.allowed_tools", ["required"]),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name", ["required"]),  # before: "input should be 'none', 'auto' or 'required'"
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", ["needs logprobs"]),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 0}, "top_logprobs", ["needs logprobs"]),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {  # as OpenAI's
        "name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters", ['"type": "object"']),
    ({"messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"]}, "modalities", ["not supported"]),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": []}, "functions", ["not supported by this server"]),
    ({"messages": [{"role": "user", "content": "hi"}], "regex": "a+"}, "regex",
     ["Unrecognized request argument supplied: regex", 'structured_outputs: {"regex": ...}']),
    ({"messages": [{"role": "user", "content": "hi"}], "lora_path": "x"}, "lora_path", ["LoRA adapters are not "
                                                                                        "supported"]),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format.json_schema",
     ['only read with type "json_schema", not "json_object"', 'send type "json_schema"']),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "text", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format.json_schema", ['not "text"']),
    ({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 2, "response_format": {"type": "json_object"}},
     "min_tokens", ["structured output"]),
    ({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 5, "max_completion_tokens": 3}, "min_tokens",
     ["max_completion_tokens=3"]),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs", ["tools"]),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}, "messages[1]",
     ["tool_call_id"]),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "messages[0]", ["'tool' message"]),
    ({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "banana"}, "reasoning_effort",
     ["'minimal'"]),
    ({"messages": [{"role": "user", "content": "hi"}], "service_tier": "gold"}, "service_tier", ["'flex'"]),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_cache_options": {"ttl": "banana"}},
     "prompt_cache_options.ttl", ["'30m'"]),  # before: any object, taken unread
    ({"messages": [{"role": "assistant", "content": "hi", "audio": {"id": "a"}}]}, "messages[0].audio",
     ["not supported", "send null"]),
    ({"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[0].function_call", ["not supported"]),
    ({"messages": [{"role": "assistant", "refusal": 5, "provider_specific_fields": {}}]}, "messages[0].refusal",
     ["valid string"]),  # a message's unknown key is ignored, its known fields as strict as ever
])
def test_bad_chat_requests_get_a_400_naming_the_field(http, body, param, words):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param, *words)


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/responses", {"input": "hi", "max_new_tokens": 4}, "send max_output_tokens instead"),
    ("/v1/responses", {"input": "hi", "json_schema": "{}"}, 'send text: {"format": {"type": "json_schema"'),
    ("/invocations", {"prompt": "hi", "sampling_seed": 1}, "send seed instead"),
    ("/v1/responses", {"input": "hi", "max_tokens": 4}, "send max_output_tokens instead"),  # another route's name
    ("/v1/completions", {"prompt": "hi", "max_completion_tokens": 4},
     "send max_tokens instead (max_completion_tokens is chat's name for it)"),
    ("/tokenize", {"prompt": "hi", "max_new_tokens": 4}, None),  # no generation route: no advice
])
def test_an_sglang_field_name_gets_a_400_saying_what_to_send_on_that_route(http, path, body, message):
    field = next(name for name in body if name not in ("input", "prompt"))
    error = assert_error(http.post(path, json=body), 400, field, f"Unrecognized request argument supplied: {field}")
    assert (f"{field}; {message}" in error["message"]) if message else error["message"].endswith(field), error


@pytest.mark.parametrize(("advice", "fields"), [
    (FOREIGN_FIELDS, set(CompletionRequest.model_fields) & set(ChatCompletionRequest.model_fields)),
    (RESPONSES_FOREIGN_FIELDS, set(ResponsesRequest.model_fields)),
])
def test_the_advice_for_foreign_field_names_sends_only_fields_the_route_takes(advice, fields):
    sent = {name for text in advice.values() for name in re.findall(r"\bsend ([a-z_]+)", text)}
    assert sent and sent <= fields, sent - fields


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi", "n": None, "stream": None, "echo": None, "logprobs": None, "best_of": None,
                         "suffix": None, "stop": None, "seed": None, "stream_options": None, "user": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": None, "stream": None,
                              "tools": None, "tool_choice": None, "response_format": None, "modalities": None,
                              "audio": None, "max_completion_tokens": None, "parallel_tool_calls": None}),
])
def test_null_is_the_default_of_every_nullable_field(http, path, body):
    response = http.post(path, json={**body, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1 and "kiln-ignored-fields" not in response.headers


def test_best_of_equal_to_n_changes_nothing_and_is_taken(http):
    response = http.post("/v1/completions", json={"prompt": "hi", "n": 2, "best_of": 2, "max_tokens": 1})
    assert response.status_code == 200, response.text  # before: a 400, though SamplingParams(n=2, best_of=2) is taken
    assert len(response.json()["choices"]) == 2


def test_malformed_json_and_non_object_bodies_get_a_400(http):
    headers = {"Content-Type": "application/json"}
    assert_error(http.post("/v1/completions", content=b'{"prompt": ', headers=headers), 400, None, "not valid JSON")
    assert_error(http.post("/v1/completions", content=b"[1, 2]", headers=headers), 400, None, "JSON object")
    assert_error(http.post("/v1/completions", content=b'"x"', headers=headers), 400, None, "JSON object, not str")
    assert_error(http.post("/v1/completions", content=b"prompt=hi"), 400, None, "application/json")
    assert_error(http.post("/v1/completions"), 400, None, "missing")


def test_unknown_model_is_a_404_and_unknown_route_keeps_the_error_shape(http):
    error = assert_error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404, "model",
                         "gpt-4", MODEL)
    assert error["code"] == "model_not_found"
    assert_error(http.post("/v1/embeddings", json={"input": "hi"}), 404, None, "POST /v1/embeddings is not served",
                 "POST /v1/chat/completions", "GET /v1/models", "POST /detokenize")


def test_the_openai_client_raises_bad_request_for_a_too_long_prompt(http):
    with openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="unused", max_retries=0) as client, \
            pytest.raises(openai.BadRequestError, match="max_input_len"):
        client.completions.create(model=MODEL, prompt=LONG_TEXT, max_tokens=4)


def test_wrong_or_missing_api_key_gets_a_401_and_probes_stay_open(llm):
    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL, api_key="sekret"))
    with ServerThread(app) as server:
        missing = httpx.post(f"{server.url}/v1/completions", json={"prompt": "{bad json"})
        assert_error(missing, 401, None, "Missing API key")
        assert missing.headers["WWW-Authenticate"] == "Bearer"
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as client, \
                pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
            client.models.list()
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekret", max_retries=0) as client:
            assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/metrics").status_code == 200
        for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110)
            headers = {"Authorization": f"{scheme} sekret"}
            assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Basic sekret"}).status_code == 401
    with ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL, api_key="sekret\n"))) as server:
        headers = {"Authorization": "Bearer sekret"}  # the key as a secret file holds it, newline and all
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200
    with pytest.raises(ValueError, match="api_key is blank"):
        ServerSettings(model_name=MODEL, api_key=" \n")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "ab\ud800c", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 2}, "messages"),
    ("/tokenize", {"prompt": "x\ud83d"}, "prompt"),
])
def test_a_lone_surrogate_in_the_text_is_a_400(http, path, body, param):
    raw = json.dumps(body)  # ASCII JSON: the lone surrogate travels as its \\udXXX escape, as a client may send it
    response = http.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})
    assert_error(response, 400, param, "lone UTF-16 surrogate")


def test_admission_refuses_beyond_capacity_until_places_are_released():
    admission = Admission(capacity=3)
    release_two = admission.reserve(2)
    admission.reserve(1)
    with pytest.raises(APIError) as full:
        admission.reserve(1)
    assert full.value.status_code == 503 and full.value.headers == {"Retry-After": "1"}
    release_two()
    release_two()  # idempotent
    assert admission.outstanding == 1
    admission.reserve(2)
    with pytest.raises(APIError) as too_big:
        admission.reserve(4)
    assert too_big.value.status_code == 400 and too_big.value.param == "n"


def test_a_full_queue_answers_503_with_retry_after_and_never_backs_up(llm):
    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL, max_queue=2))  # 16 running + 2 queued
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(40)))

    with ServerThread(app) as server:
        responses = asyncio.run(main())
        metrics = httpx.get(f"{server.url}/metrics").text
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 503} and statuses.count(200) >= 18
    refused = next(r for r in responses if r.status_code == 503)
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["type"] == "server_overloaded"
    # backpressure told apart from failures, which are 503s too
    assert f'kiln_requests_refused_total{{reason="capacity"}} {statuses.count(503)}.0' in metrics
    assert 'kiln_requests_refused_total{reason="engine_stopped"} 0.0' in metrics
    wait_until(lambda: engine_idle(llm))


def test_health_is_503_while_the_engine_loads_then_200():
    release = threading.Event()

    def slow_load() -> LLM:
        release.wait(10)
        return LLM.load(tiny_engine())

    app = create_app(slow_load, tiny_engine(), ServerSettings(model_name=MODEL))
    with ServerThread(app) as server:
        loading = httpx.get(f"{server.url}/health")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        refused = httpx.get(f"{server.url}/v1/models")
        assert_error(refused, 503, None, "still loading")
        assert refused.headers["Retry-After"] == "1"
        assert 'kiln_requests_refused_total{reason="loading"} 1.0' in httpx.get(f"{server.url}/metrics").text
        release.set()
        wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 200)


def test_an_engine_that_fails_to_load_stops_the_server_with_its_message():
    def broken_load() -> LLM:
        raise KilnError("engine.json is corrupt")

    app = create_app(broken_load, tiny_engine(), ServerSettings(model_name=MODEL))
    with pytest.raises(ServerStartError, match="engine.json is corrupt"):
        run_server(app, "127.0.0.1", 0, shutdown_timeout_s=1)


def test_a_bug_while_the_engine_loads_is_logged_with_its_traceback(caplog):
    def buggy_load() -> LLM:
        return {}["oops"]

    app = create_app(buggy_load, tiny_engine(), ServerSettings(model_name=MODEL))
    with pytest.raises(ServerStartError, match="oops") as failed:
        run_server(app, "127.0.0.1", 0, shutdown_timeout_s=1)
    assert isinstance(failed.value.__cause__, KeyError)
    assert any(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records)


def test_an_address_the_server_cannot_listen_on_is_refused_naming_why_before_the_engine_loads():
    def never_loaded() -> LLM:
        raise AssertionError("the engine was loaded")

    app = create_app(never_loaded, tiny_engine(), ServerSettings(model_name=MODEL))
    with pytest.raises(ServerStartError, match="cannot serve on host '999.1.1.1'"):
        ServerThread(app, "999.1.1.1").start()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ServerStartError, match="Address already in use; is another server on that port"):
            ServerThread(app, "127.0.0.1", taken.getsockname()[1]).start()


def test_bodies_over_the_bound_get_a_413_before_they_are_read_and_others_are_served(llm):
    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL, max_body_bytes=4000))
    with ServerThread(app) as server:
        big = {"prompt": "x" * 5000, "max_tokens": 2}
        refused = httpx.post(f"{server.url}/v1/completions", json=big)
        assert_error(refused, 413, None, "larger than this server")
        assert refused.headers["connection"] == "close"  # never reused (h11 would read a refused body on, unbounded)

        def chunks():  # no Content-Length: the bound applies as the body arrives
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'", "max_tokens": 2}'

        chunked = httpx.post(f"{server.url}/v1/completions", content=chunks(),
                             headers={"Content-Type": "application/json"})
        assert_error(chunked, 413, None, "larger than this server")
        assert chunked.headers["connection"] == "close"
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
        gzipped = httpx.post(f"{server.url}/v1/completions", content=b"\x1f\x8b...",
                             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert_error(gzipped, 415, None, "Content-Encoding 'gzip' is not supported")
        with socket.create_connection(("127.0.0.1", server.port)) as declared:  # answered before its body: closed,
            declared.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100000000\r\n\r\n")  # not read on, nor the next request taken for it
            declared.settimeout(2)  # at once, not after the body timeout
            answer = b""
            while chunk := declared.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 413 ")


def test_too_many_prompts_or_too_long_a_text_are_refused_before_tokenizing(http, llm):
    many = {"prompt": ["ab"] * 100_000, "max_tokens": 2}
    assert_error(http.post("/v1/completions", json=many), 400, "prompt", "sequences but the server holds at most")
    bound = llm.limits.max_input_len * llm.tokenizer.max_token_bytes
    long_text = {"prompt": "z" * (bound + 1), "max_tokens": 2}
    assert_error(http.post("/v1/completions", json=long_text), 400, "prompt", "characters, more than")


def test_n_over_the_sequences_the_server_holds_is_refused_naming_n(llm):
    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL, max_queue=1))  # holds 16 + 1
    with ServerThread(app) as server:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            answer = httpx.post(f"{server.url}{path}", json={**body, "n": 18, "max_tokens": 1})
            assert_error(answer, 400, "n", "needs 18 sequences but the server holds at most 17")  # before: "prompt"


def test_a_50_mb_body_and_a_surrogate_prompt_during_streams_leave_the_streams_whole(llm):
    import threading
    import time

    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL))
    gaps: list[float] = []
    finished: list[list[str]] = []

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            last, events = time.perf_counter(), []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now
                    events.append(line[6:])
        finished.append(events)

    with ServerThread(app) as server:
        streams = [threading.Thread(target=stream) for _ in range(4)]
        for thread in streams:
            thread.start()
        declared = httpx.post(f"{server.url}/v1/completions", content=b"x" * (50 << 20),
                              headers={"Content-Type": "application/json"}, timeout=120)

        def fifty_megabytes():
            yield b'{"prompt": "'
            for _ in range(50):
                yield b"a" * (1 << 20)
            yield b'"}'

        chunked = httpx.post(f"{server.url}/v1/completions", content=fifty_megabytes(),
                             headers={"Content-Type": "application/json"}, timeout=120)
        surrogate = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "a\\ud800", "max_tokens": 2}',
                               headers={"Content-Type": "application/json"}, timeout=120)
        for thread in streams:
            thread.join(120)
    assert (declared.status_code, chunked.status_code, surrogate.status_code) == (413, 413, 400)
    assert len(finished) == 4 and all(events[-1] == "[DONE]" for events in finished)
    print(f"largest gap between events of the other streams: {max(gaps) * 1000:.0f} ms")  # docs/serving.md


def test_a_huge_request_head_gets_a_431_and_a_trickled_one_is_cut_off_while_others_are_served(llm):
    pytest.importorskip("httptools")  # the serve extra's parser, which uvicorn leaves unbounded
    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL))
    with ServerThread(app, head_timeout_s=0.5) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as huge:
            huge.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
            assert huge.recv(100).startswith(b"HTTP/1.1 431 ")
        with socket.create_connection(("127.0.0.1", server.port)) as endless:  # one header that never ends
            endless.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
            with contextlib.suppress(OSError):  # the server may close before all of it is sent
                for _ in range(64):
                    endless.sendall(b"a" * 4096)
            assert endless.recv(100).startswith(b"HTTP/1.1 431 ")
        with socket.create_connection(("127.0.0.1", server.port)) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-a: ")  # and nothing more
            slow.settimeout(10)
            assert httpx.get(f"{server.url}/health").status_code == 200  # the others are served meanwhile
            assert slow.recv(100) == b""  # closed once its head was overdue
        with socket.create_connection(("127.0.0.1", server.port)) as ok:  # a whole head, a keep-alive answer
            ok.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert ok.recv(100).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection(("127.0.0.1", server.port)) as pipelined:  # a large body, then the next
            body = b'{"tokens": [' + b"5, " * 30_000 + b'5]}'  # request's first bytes, in one write
            pipelined.sendall(b"POST /detokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (len(body), body) + b"GET /heal")
            time.sleep(0.3)
            pipelined.sendall(b"th HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            pipelined.settimeout(10)
            answers = b""
            while chunk := pipelined.recv(65536):
                answers += chunk
            assert answers.count(b"HTTP/1.1 ") == 2 and b" 431 " not in answers


def test_a_request_body_that_stops_arriving_gets_a_408_while_one_sent_in_pieces_is_read(llm):
    pytest.importorskip("httptools")  # the serve extra's parser, which uvicorn leaves unbounded
    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL))
    head = b"POST /detokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    body = b'{"tokens": [5, 6, 7]}'
    with ServerThread(app, body_timeout_s=1.5) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as stalled:
            stalled.sendall(head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:5]))  # and no more
            stalled.settimeout(10)
            answer = b"".join(iter(lambda: stalled.recv(4096), b""))
        assert answer.startswith(b"HTTP/1.1 408 ") and b"paused for more than 1.5 s" in answer
        with socket.create_connection(("127.0.0.1", server.port)) as paced:  # 2 s in all, never 1.5 s idle
            paced.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body))
            for start in range(0, len(body), 6):
                time.sleep(0.5)
                paced.sendall(body[start:start + 6])
            paced.settimeout(10)
            assert b"".join(iter(lambda: paced.recv(4096), b"")).startswith(b"HTTP/1.1 200 ")


def test_a_generation_the_engine_fails_is_logged_with_its_request_id_streamed_or_not(llm, monkeypatch):
    import io
    import logging

    from kiln.runtime.errors import EngineClosedError
    from kiln.runtime.server.generation import ServedModel
    from kiln.runtime.server.serve import stderr_log_handler

    async def failed(*_) -> None:  # as the engine's process killed mid-request ends it
        raise EngineClosedError("the engine process was killed by signal 9")

    async def failed_stream(*_, **__):
        await failed()
        yield

    monkeypatch.setattr(ServedModel, "generate_final", failed)
    monkeypatch.setattr(ServedModel, "generate", failed_stream)
    handler = stderr_log_handler()
    handler.setStream(log := io.StringIO())
    logging.getLogger("kiln.server").addHandler(handler)
    try:
        app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL))
        with ServerThread(app) as server:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            for request_id, stream in (("plain-1", False), ("streamed-1", True)):
                httpx.post(f"{server.url}/v1/completions", json={**body, "stream": stream},
                           headers={"X-Request-Id": request_id})
    finally:
        logging.getLogger("kiln.server").removeHandler(handler)
    lines = log.getvalue()
    assert "ERROR kiln.server [plain-1]: POST /v1/completions: 503 generation failed: the engine process" in lines
    assert "ERROR kiln.server [streamed-1]: stream failed: EngineClosedError: the engine process" in lines


def test_the_engine_knows_a_request_by_the_clients_x_request_id_streamed_or_not(llm, monkeypatch):
    from kiln.runtime.llm import LLM

    seen, real = [], LLM.stream_many

    def recording(self, prompts, params=None, **kwargs):
        seen.append(kwargs["request_ids"])
        return real(self, prompts, params, **kwargs)

    monkeypatch.setattr(LLM, "stream_many", recording)
    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL))
    with ServerThread(app) as server:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2}
        for stream in (False, True, True):  # the same id twice: the engine's ids stay apart
            httpx.post(f"{server.url}/v1/completions", json={**body, "stream": stream},
                       headers={"X-Request-Id": "trace-7"}).raise_for_status()
    assert [[engine_id.rsplit("-", 1)[0] for engine_id in ids] for ids in seen] == [["trace-7-0", "trace-7-1"]] * 3
    assert len({engine_id for ids in seen for engine_id in ids}) == 6


def test_a_request_whose_constraints_allow_no_token_is_a_400_saying_so(http):
    body = {"prompt": "The cat sat on the", "max_tokens": 4, "temperature": 0, "allowed_token_ids": [5, 6],
            "structured_outputs": {"choice": ["mat", "roof"]}}  # neither choice starts with token 5 or 6
    assert_error(http.post("/v1/completions", json=body), 400, None, "no token is allowed")


def test_an_empty_text_prompt_is_taken_for_the_tokenizer_to_give_its_bos():
    from kiln.runtime.server.protocol import CompletionRequest

    # OpenAI and vLLM serve "" from the BOS alone; a tokenizer that adds none leaves no token (the 400 above)
    assert CompletionRequest.model_validate({"prompt": ""}).prompt == ""
    assert CompletionRequest.model_validate({"prompt": ["", "a"]}).prompt == ["", "a"]


def test_a_request_without_an_output_format_takes_no_worker_thread(monkeypatch):
    from kiln.runtime.server import jobs
    from kiln.runtime.server.protocol import ChatCompletionRequest

    def no_thread(*args, **kwargs):  # a pool held by other requests' long tokenizations would hold this one up
        raise AssertionError("took a worker thread")

    monkeypatch.setattr(jobs.asyncio, "to_thread", no_thread)
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                  "response_format": {"type": "text"}})
    assert asyncio.run(jobs.compiled_format(plain)) is None
    with pytest.raises(AssertionError, match="worker thread"):
        asyncio.run(jobs.compiled_format(plain.model_copy(update={"response_format": None,
                                                                  "structured_outputs": {"regex": "a"}})))


def test_an_error_quoting_a_lone_surrogate_the_request_escaped_keeps_it_an_escape():
    from kiln.runtime.server.errors import APIError, error_response

    body = error_response(APIError(404, "The model 'x\ud800' does not exist")).body  # the model a request named
    assert b"'x\\ud800'" in body  # before: a 500, as UTF-8 cannot carry a lone surrogate


def test_token_ids_may_be_integral_floats_as_every_integer_field_takes_them():
    from kiln.runtime.server.protocol import CompletionRequest

    assert CompletionRequest(prompt=[3.0, 4]).prompt == [3, 4]
    assert CompletionRequest(prompt=[[3.0], [4]]).prompt == [[3], [4]]
