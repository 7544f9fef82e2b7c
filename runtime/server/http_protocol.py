"""The HTTP/1.1 protocol uvicorn runs, with the bounds it lacks on what a client sends before its body: the request
line and headers of a request take at most MAX_HEAD_BYTES (else 431, and the connection closes) and must arrive
within HEAD_TIMEOUT_S of the connection opening or the request starting (else the connection closes), so that
neither one huge header nor many connections that trickle theirs (slowloris) hold the server's memory or sockets.
A request's body must not pause for more than BODY_TIMEOUT_S between two chunks (else 408, and the connection
closes), so that a body that never ends does not hold its connection (and a shutdown) either. uvicorn buffers headers
without limit and times out only idle keep-alive connections; nginx answers the same way
(``large_client_header_buffers``, ``client_header_timeout``, ``client_body_timeout``). When the server shuts down, a
request whose body is still arriving is answered 503 and its connection closed at once: it could only be refused
(the server drains first), and uvicorn would otherwise wait for the body, then cancel its handler with a traceback.

Without httptools (uvicorn's fast parser, in the serve extra) h11 runs, bounded in size only."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger("kiln.server")

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 60.0  # nginx's client_body_timeout


def _plain_response(status: bytes, text: str) -> bytes:
    """A complete plain-text response that closes the connection."""
    body = text.encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, len(body), body))


_TOO_LARGE = _plain_response(b"431 Request Header Fields Too Large",
                             f"the request line and headers take more than {MAX_HEAD_BYTES // 1024} KiB")
_SHUTTING_DOWN = _plain_response(b"503 Service Unavailable",
                                 "the server is shutting down: retry against another replica")


def http_protocol_options(head_timeout_s: float = HEAD_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S) -> dict:
    """The ``uvicorn.Config`` keywords that pick the bounded protocol, its heads due within ``head_timeout_s`` and
    its bodies' chunks within ``body_timeout_s`` of each other."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: h11, whose parser bounds an incomplete head
        return {"http": "h11", "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
    return {"http": _bounded(HttpToolsProtocol, head_timeout_s, body_timeout_s)}


class _Deadline:
    """A timer on ``loop`` that calls ``on_expiry`` ``seconds`` after its last ``start``, unless stopped first."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float, on_expiry: Callable[[], None]) -> None:
        self._loop, self._seconds, self._on_expiry = loop, seconds, on_expiry
        self._handle: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        self.stop()
        self._handle = self._loop.call_later(self._seconds, self._expire)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _expire(self) -> None:
        self._handle = None
        self._on_expiry()


def _bounded(base: type, head_timeout_s: float, body_timeout_s: float) -> type:
    too_slow = _plain_response(b"408 Request Timeout", f"the request body paused for more than {body_timeout_s:g} s: "
                                                       f"send it without pausing")

    class BoundedHttpToolsProtocol(base):
        """uvicorn's httptools protocol, its request heads bounded in size and time, its bodies in time."""

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._head_bytes, self._head_raw, self._answered, self._began = 0, 0, False, False
            self._head = _Deadline(self.loop, head_timeout_s, self._head_too_slow)
            self._body = _Deadline(self.loop, body_timeout_s, self._body_too_slow)
            self._head.start()  # a connection that never sends a byte is cut off too

        def connection_lost(self, exc: Exception | None) -> None:
            self._head.stop()
            self._body.stop()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = self._head_raw = 0
            self._began = True  # the chunk being read ended another message: its bytes are not all head bytes
            self._head.start()

        def data_received(self, data: bytes) -> None:
            in_head = self._head.running  # a head under way before this chunk
            self._began = False
            super().data_received(data)
            # httptools joins a header's pieces until it ends, so on_header never sees a huge unfinished one: count
            # the raw bytes of each later chunk that leaves the head unfinished
            if in_head and not self._began and self._head.running and not self._answered:
                self._head_raw += len(data)
                if self._head_raw > MAX_HEAD_BYTES:
                    self._refuse()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._head.stop()
            super().on_headers_complete()
            if not (self.parser.should_upgrade() and self._should_upgrade()):  # a WebSocket's is not a body
                self._body.start()  # on_message_complete ends it, at once for a request without a body

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            self._body.start()

        def on_message_complete(self) -> None:
            self._body.stop()
            super().on_message_complete()

        def shutdown(self) -> None:
            cycle = self.cycle
            if cycle is None or not cycle.more_body or cycle.response_started or self.transport.is_closing():
                super().shutdown()
                return
            logger.info("shutting down: a request whose body was still arriving got 503 (%s %s)", cycle.scope["method"],
                        cycle.scope["path"])
            self.transport.write(_SHUTTING_DOWN)
            self.transport.close()  # the handler reads a disconnect and ends: nothing is left to cancel

        def on_response_complete(self) -> None:
            # answered before its body was all read (413, 401, 404, an Expect: 100-continue refused): the rest of
            # the body would be read and dropped without bound, or the next request taken for it; close instead
            if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
                self.transport.close()
            super().on_response_complete()

        def send_400_response(self, msg: str) -> None:
            if not self._answered:  # a head too large was answered 431 already
                super().send_400_response(msg)

        def _count(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse()
                raise ValueError("request head too large")  # stops the parser (uvicorn sees a parser error)

        def _refuse(self) -> None:
            self._answered = True
            self._head.stop()
            self.transport.write(_TOO_LARGE)
            self.transport.close()

        def _head_too_slow(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def _body_too_slow(self) -> None:
            if self.transport.is_closing():
                return
            if self.flow.read_paused or self.cycle.waiting_for_100_continue:  # the server, not the client, is behind
                self._body.start()
                return
            if not self.cycle.response_started:
                self.transport.write(too_slow)
            self.transport.close()

    return BoundedHttpToolsProtocol
