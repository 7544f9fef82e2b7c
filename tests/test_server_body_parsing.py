"""Request bodies are parsed within bounds on their shape (a 400 naming the bound, before any parsing that would stall
the server), large ones off the event loop; a body still arriving when the server shuts down is answered 503 and
dropped, without a traceback. The app runs without an engine: bodies are parsed before a route asks for one."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from kiln.runtime.server import ServerSettings, ServerThread, create_app, json_body
from kiln.runtime.server.json_body import MAX_CONTAINERS, MAX_DEPTH, MAX_VALUES, THREAD_THRESHOLD_BYTES

NOT_LOADED = 503  # what a body that passes parsing gets from an app whose engine has not loaded


def app_without_engine(loaded: threading.Event | None = None):
    def never_loads():
        (loaded or threading.Event()).wait()
        raise RuntimeError("no engine in these tests")

    return create_app(never_loads, Path("unused"), ServerSettings(model_name="m"))


async def post(body: bytes, path: str = "/v1/completions") -> httpx.Response:
    transport = httpx.ASGITransport(app=app_without_engine())
    async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as client:
        return await client.post(path, content=body, headers={"content-type": "application/json"})


def completion(prompt: bytes) -> bytes:
    return b'{"model": "m", "prompt": ' + prompt + b'}'


def refused(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000])
def test_a_body_nested_too_deep_is_refused_naming_the_depth(depth):
    refused(asyncio.run(post(completion(b"[" * depth + b"1" + b"]" * depth))), f"more than {MAX_DEPTH} levels deep")


def test_a_15_mib_body_of_small_arrays_is_refused_at_once_and_the_event_loop_keeps_serving():
    item = b"[[1]],"
    body = completion(b"[" + item * ((15 << 20) // len(item)) + b"[[1]]]")  # takes seconds for json.loads

    async def refuse_while_ticking() -> tuple[httpx.Response, float]:
        lag, done = 0.0, False

        async def tick() -> None:
            nonlocal lag
            while not done:
                start = time.perf_counter()
                await asyncio.sleep(0.001)
                lag = max(lag, time.perf_counter() - start)

        ticker = asyncio.create_task(tick())
        response = await post(body)
        done = True
        await ticker
        return response, lag

    response, lag = asyncio.run(refuse_while_ticking())
    refused(response, f"more than {MAX_CONTAINERS} JSON arrays and objects")
    assert lag < 0.5, f"the event loop stalled for {lag:.2f} s"


def test_a_body_of_too_many_values_is_refused_naming_the_bound():  # validating them would stall the event loop
    refused(asyncio.run(post(completion(b"[" + b"1," * MAX_VALUES + b"1]"))), f"more than {MAX_VALUES} JSON values")


def test_brackets_inside_strings_do_not_count():
    text = b'"' + b'[{\\"a\\": 1},' * (MAX_CONTAINERS + 1) + b'"'
    assert asyncio.run(post(completion(text))).status_code == NOT_LOADED


def test_a_long_conversation_and_long_token_id_prompts_are_taken():  # what vLLM and OpenAI take
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}] * 7000
    body = json.dumps({"model": "m", "messages": messages}).encode()
    assert asyncio.run(post(body, "/v1/chat/completions")).status_code == NOT_LOADED
    assert asyncio.run(post(completion(json.dumps([[1] * 130_000] * 4).encode()))).status_code == NOT_LOADED


def test_a_body_that_is_not_json_still_says_where():
    refused(asyncio.run(post(b'{"model": "m", "prompt": [[1], [2}')), "not valid JSON", "at character")


@pytest.mark.parametrize(("size", "off_the_loop"), [(1000, False), (THREAD_THRESHOLD_BYTES + 1, True)])
def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch, size, off_the_loop):
    threads, parse = [], json_body.parse_json

    def parse_noting_the_thread(body: bytes) -> object:
        threads.append(threading.current_thread())
        return parse(body)

    monkeypatch.setattr(json_body, "parse_json", parse_noting_the_thread)
    assert asyncio.run(post(completion(b'"' + b"x" * size + b'"'))).status_code == NOT_LOADED
    assert [thread is not threading.main_thread() for thread in threads] == [off_the_loop]


def test_a_body_still_arriving_at_shutdown_gets_503_without_a_traceback(caplog):
    loaded = threading.Event()
    server = ServerThread(app_without_engine(loaded), shutdown_timeout_s=5).start()
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate to caplog's
    uvicorn_log.addHandler(caplog.handler)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 100000\r\n\r\n{\"model\": ")  # and the rest still to come
            time.sleep(0.2)  # the route is reading the body
            start = time.monotonic()
            server.stop()
            stopped_in = time.monotonic() - start
            answer = client.recv(4096)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
        loaded.set()
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert stopped_in < 2, f"shutdown waited {stopped_in:.1f} s for the body"  # not the 5 s timeout, then a cancel
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR or record.exc_info]
