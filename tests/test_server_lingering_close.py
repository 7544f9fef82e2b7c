"""An answer sent before the request's body was all read (a wrong API key's 401, an unknown route's 404) reaches a
client still sending a multi-MB body: the server reads and drops the rest of the body, never as a next request, and
only then closes the connection, which the answer says it will; closing at once had reset the connection and lost
the answer (the OpenAI client saw APIConnectionError and sent the body again)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request

from kiln.runtime.server.app import APIKeyMiddleware
from kiln.runtime.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from kiln.runtime.server.http_protocol import http_protocol_options

KEYED = b"Host: x\r\nAuthorization: Bearer sekret\r\n"
BODY = b"x" * (4 << 20)  # far more than the sockets' buffers hold: a server that closes early resets the sender


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """A keyed app that answers /v1/echo with the length of the body it read, on a free port."""
    api = FastAPI()

    @api.post("/v1/echo")
    async def echo(request: Request) -> int:
        return len(await request.body())

    app = APIKeyMiddleware(BodyLimitMiddleware(api, DEFAULT_MAX_BODY_BYTES), ("sekret",))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off",
                                           **http_protocol_options()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_a_wrong_api_key_on_a_4_mb_prompt_is_answered_401_not_with_a_reset(url):
    async def complete() -> None:
        async with openai.AsyncOpenAI(api_key="wrong", base_url=f"{url}/v1", max_retries=0) as client:
            await client.completions.create(model="m", prompt="hello world " * 350_000, max_tokens=1)

    with pytest.raises(openai.AuthenticationError):  # before: APIConnectionError (a reset)
        asyncio.run(complete())


def test_the_body_after_a_404_is_dropped_not_served_and_a_body_read_whole_keeps_its_connection(url):
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"POST /v1/echo HTTP/1.1\r\n" + KEYED + b"Content-Length: 3\r\n\r\nabc")
        assert client.recv(65536).startswith(b"HTTP/1.1 200 ")  # kept alive for the next request
        # a body that spells a request, and a request after it: neither is served
        body = b"GET /v1/echo HTTP/1.1\r\nHost: x\r\n\r\n".ljust(len(BODY), b"x")
        client.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body +
                       b"POST /v1/echo HTTP/1.1\r\n" + KEYED + b"Content-Length: 0\r\n\r\n")
        answer = b""
        while chunk := client.recv(65536):  # before: ConnectionResetError
            answer += chunk
    head, _ = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 404 ")
    assert b"connection: close" in head.lower()  # a client does not reuse the connection that closes
    assert answer.count(b"HTTP/1.1 ") == 1
