"""Bodies over the bound, sent whole by several clients at once (declared and chunked) while other requests are
served, are each answered 413, not with a connection reset: the server reads and drops the rest of a refused body
before it closes the connection, a declared one whole up to DRAIN_BYTES past the bound, a chunked one also when its
client waited for "100 Continue"."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from kiln.runtime.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from kiln.runtime.server.http_protocol import http_protocol_options

MAX_BYTES = 4000
BODY_BYTES = 32 << 20  # far more than the sockets' buffers hold: a server that closes early resets the sender
PIECE = b"x" * (1 << 20)


async def echo_length(scope, receive, send) -> None:
    """An app that reads the whole body and answers its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(size).encode()})


def serve(max_bytes: int):
    """Serve ``echo_length`` behind the bound ``max_bytes`` on a free port, and yield the port."""
    config = uvicorn.Config(BodyLimitMiddleware(echo_length, max_bytes), host="127.0.0.1", port=0, log_level="error",
                            lifespan="off", **http_protocol_options())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def port():
    yield from serve(MAX_BYTES)


@pytest.fixture(scope="module")
def default_port():
    yield from serve(DEFAULT_MAX_BODY_BYTES)


def send_oversize(port: int, chunked: bool, size: int = BODY_BYTES, expect: bool = False) -> bytes:
    """Send a whole oversize body of ``size`` bytes (a multiple of 1 MiB), as a client that reads the answer only
    after it sent its body (with ``expect``, after "100 Continue" came), and return that answer up to the
    connection's end (a reset raises)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % size
        client.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n" +
                       (b"Expect: 100-continue\r\n" if expect else b"") + b"\r\n")
        if expect:
            interim = b""
            while not interim.endswith(b"\r\n\r\n"):
                interim += client.recv(1)
            assert interim.startswith(b"HTTP/1.1 100 "), interim
        for _ in range(size // len(PIECE)):
            client.sendall(b"%x\r\n%s\r\n" % (len(PIECE), PIECE) if chunked else PIECE)
        if chunked:
            client.sendall(b"0\r\n\r\n")
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
        return answer


def assert_413(answer: bytes) -> None:
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()
    assert "larger than this server accepts" in json.loads(body)["error"]["message"]


def test_oversize_bodies_sent_at_once_each_get_a_413_not_a_reset_while_others_are_served(port):
    url = f"http://127.0.0.1:{port}/"
    with ThreadPoolExecutor(8) as pool:
        refused = [pool.submit(send_oversize, port, chunked) for chunked in (False, True) * 3]
        served = [pool.submit(httpx.post, url, content=b"y" * 1000) for _ in range(10)]
        answers = [future.result() for future in refused]  # before: ConnectionResetError while sending
        assert [(r.status_code, r.text) for r in (future.result() for future in served)] == [(200, "1000")] * 10
    for answer in answers:
        assert_413(answer)


def test_a_declared_body_up_to_drain_bytes_past_the_bound_is_read_whole_before_its_413(default_port):
    # 60 MiB past the 16 MiB bound: within DRAIN_BYTES past it, but longer than DRAIN_BYTES in all
    assert_413(send_oversize(default_port, False, DEFAULT_MAX_BODY_BYTES + (60 << 20)))  # before: a reset


def test_a_chunked_body_sent_after_100_continue_is_drained_before_its_413(port):
    assert_413(send_oversize(port, True, expect=True))  # before: a reset (no drain when Expect was sent)
