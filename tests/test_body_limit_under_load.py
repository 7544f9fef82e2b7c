"""Bodies over the bound, sent whole by several clients at once (declared and chunked) while other requests are
served, are each answered 413, not with a connection reset: the server reads and drops the rest of a refused body
before it closes the connection."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from kiln.runtime.server.body_limit import BodyLimitMiddleware
from kiln.runtime.server.http_protocol import http_protocol_options

MAX_BYTES = 4000
BODY = b"x" * (32 << 20)  # far more than the sockets' buffers hold: a server that closes early resets the sender


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


@pytest.fixture(scope="module")
def port():
    config = uvicorn.Config(BodyLimitMiddleware(echo_length, MAX_BYTES), host="127.0.0.1", port=0, log_level="error",
                            lifespan="off", **http_protocol_options())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(10)


def send_oversize(port: int, chunked: bool) -> bytes:
    """Send a whole oversize body, as a client that reads the answer only after it sent its body, and return that
    answer up to the connection's end (a reset raises)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(BODY)
        client.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n\r\n")
        if chunked:
            for start in range(0, len(BODY), 1 << 20):
                client.sendall(b"%x\r\n%s\r\n" % (1 << 20, BODY[start:start + (1 << 20)]))
            client.sendall(b"0\r\n\r\n")
        else:
            client.sendall(BODY)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
        return answer


def test_oversize_bodies_sent_at_once_each_get_a_413_not_a_reset_while_others_are_served(port):
    url = f"http://127.0.0.1:{port}/"
    with ThreadPoolExecutor(8) as pool:
        refused = [pool.submit(send_oversize, port, chunked) for chunked in (False, True) * 3]
        served = [pool.submit(httpx.post, url, content=b"y" * 1000) for _ in range(10)]
        answers = [future.result() for future in refused]  # before: ConnectionResetError while sending
        assert [(r.status_code, r.text) for r in (future.result() for future in served)] == [(200, "1000")] * 10
    for answer in answers:
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()
        assert "larger than this server accepts" in json.loads(body)["error"]["message"]
