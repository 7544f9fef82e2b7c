"""The HTTP/1.1 protocol uvicorn runs, with the bounds it lacks on what a client sends before its body: the request
line and headers of a request take at most MAX_HEAD_BYTES (else 431, and the connection closes) and must arrive
within HEAD_TIMEOUT_S of the connection opening or the request starting (else the connection closes), so that
neither one huge header nor many connections that trickle theirs (slowloris) hold the server's memory or sockets.
A request's body must not pause for more than BODY_TIMEOUT_S between two chunks (else 408, and the connection
closes): a client that stops sending does not hold its connection (or a shutdown), though one that sends a byte
more often than that still can, as under nginx. uvicorn buffers headers without limit and times out only idle
keep-alive connections; nginx answers the same way (``large_client_header_buffers``, ``client_header_timeout``,
``client_body_timeout``). When the server shuts down, a request whose body is still arriving is answered 503 and its
connection closed at once: it could only be refused (the server drains first), and uvicorn would otherwise wait for
the body, then cancel its handler with a traceback.

An answer that starts before its request's body has ended (413, 401, 404, 415) says ``connection: close``, and the
rest of the body is read and dropped, never parsed as a next request, before the connection closes, as nginx's
lingering close does: a server that closes while the client is still sending resets the connection, and the client's
TCP stack drops the answer it had not read yet. The drain ends at the body's end, after DRAIN_S, or once the body
passes the bound on bodies plus DRAIN_BYTES; there is none for a declared body longer than that, nor for one whose
client waits for "100 Continue" and has sent none of it.

Without httptools (uvicorn's fast parser, in the serve extra) h11 runs, bounded in size only, with no lingering
close."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kiln.runtime.server.body_limit import DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger("kiln.server")

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 60.0  # nginx's client_body_timeout
DRAIN_BYTES = 64 << 20  # of a body answered early, read and dropped past the bound on bodies; a longer one is cut off
DRAIN_S = 5.0


def _plain_response(status: bytes, text: str) -> bytes:
    """A complete plain-text response that closes the connection."""
    body = text.encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, len(body), body))


_TOO_LARGE = _plain_response(b"431 Request Header Fields Too Large",
                             f"the request line and headers take more than {MAX_HEAD_BYTES // 1024} KiB")
_SHUTTING_DOWN = _plain_response(b"503 Service Unavailable",
                                 "the server is shutting down: retry against another replica")


def http_protocol_options(head_timeout_s: float = HEAD_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
                          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> dict:
    """The ``uvicorn.Config`` keywords that pick the bounded protocol, its heads due within ``head_timeout_s``, its
    bodies' chunks within ``body_timeout_s`` of each other, and a body answered early drained up to DRAIN_BYTES past
    ``max_body_bytes``."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: h11, whose parser bounds an incomplete head
        return {"http": "h11", "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
    return {"http": _bounded(HttpToolsProtocol, head_timeout_s, body_timeout_s, max_body_bytes + DRAIN_BYTES)}


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


class _CycleTransport:
    """``transport`` as a request's cycle writes to it, closed by ``close``: the protocol's, which drains a body
    answered early first."""

    def __init__(self, transport: asyncio.Transport, close: Callable[[], None]) -> None:
        self._transport, self.close = transport, close

    def write(self, data: bytes) -> None:
        self._transport.write(data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()


def _bounded(base: type, head_timeout_s: float, body_timeout_s: float, drain_cap: int) -> type:
    too_slow = _plain_response(b"408 Request Timeout", f"the request body paused for more than {body_timeout_s:g} s: "
                                                       f"send it without pausing")

    class BoundedHttpToolsProtocol(base):
        """uvicorn's httptools protocol, its request heads bounded in size and time, its bodies in time, a body
        answered early drained (up to ``drain_cap`` bytes in all) before the connection closes."""

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._head_bytes, self._head_raw, self._answered, self._began = 0, 0, False, False
            self._body_bytes, self._lingering, self._keep_alive = 0, False, None
            self._head = _Deadline(self.loop, head_timeout_s, self._close)
            self._body = _Deadline(self.loop, body_timeout_s, self._body_too_slow)
            self._linger = _Deadline(self.loop, DRAIN_S, self._close)
            self._cycle_transport = _CycleTransport(transport, self._close_after_answer)
            self._head.start()  # a connection that never sends a byte is cut off too

        def connection_lost(self, exc: Exception | None) -> None:
            self._head.stop()
            self._body.stop()
            self._linger.stop()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = self._head_raw = self._body_bytes = 0
            self._keep_alive = None  # whether the request asked to keep the connection: set with its cycle
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
            if self._lingering:  # a request after the drained body: not served, the connection closes
                return
            super().on_headers_complete()
            if self.parser.should_upgrade() and self._should_upgrade():  # a WebSocket's: no cycle, no body
                return
            self.cycle.transport = self._cycle_transport
            # an answer that starts before the body has ended closes the connection, after a drain, and says so
            self._keep_alive, self.cycle.keep_alive = self.cycle.keep_alive, False
            self._body.start()  # on_message_complete ends it, at once for a request without a body

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            self._body_bytes += len(body)
            if not self._lingering:
                self._body.start()
            elif self._body_bytes > drain_cap:
                self._close()

        def on_message_complete(self) -> None:
            self._body.stop()
            super().on_message_complete()
            if self._lingering:  # the rest of the body was dropped
                self._close()
            elif self._keep_alive is not None and not self.cycle.response_started:
                self.cycle.keep_alive = self._keep_alive

        def shutdown(self) -> None:
            if self._lingering:  # it closes within DRAIN_S
                return
            cycle = self.cycle
            if cycle is None or not cycle.more_body or cycle.response_started or self.transport.is_closing():
                super().shutdown()
                return
            logger.info("shutting down: a request whose body was still arriving got 503 (%s %s)", cycle.scope["method"],
                        cycle.scope["path"])
            self.transport.write(_SHUTTING_DOWN)
            self.transport.close()  # the handler reads a disconnect and ends: nothing is left to cancel

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._lingering:
                self._unset_keepalive_if_required()  # DRAIN_S bounds the drain

        def _close_after_answer(self) -> None:
            """Close the connection as a request's cycle asks: after a drain if it answered before the body ended."""
            cycle = self.cycle  # the latest request: an earlier one's answer does not end its body
            if cycle.response_complete and cycle.more_body and not self.transport.is_closing():
                self._drain()
            else:
                self._close()

        def send_400_response(self, msg: str) -> None:
            if self._answered or self._lingering:  # answered already (431, or before the body ended)
                self._close()
            else:
                super().send_400_response(msg)

        def _drain(self) -> None:
            """Read and drop the rest of the body, within DRAIN_S and up to ``drain_cap`` bytes of body in all, then
            close; at once where nothing is to come: a declared body longer than that, or one whose client waits
            for "100 Continue" (the answer refused it) and has sent none of it."""
            declared = dict(self.cycle.scope["headers"]).get(b"content-length", b"")
            if (self.expect_100_continue and not self._body_bytes) or (declared.isdigit()
                                                                        and int(declared) > drain_cap):
                self._close()
                return
            self._lingering = True
            self._body.stop()
            self._linger.start()
            self.flow.resume_reading()

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

        def _close(self) -> None:
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
