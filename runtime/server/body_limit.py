"""A bound on request bodies, applied before anything parses them: a declared ``Content-Length`` over the bound is
answered 413 at once, and a body sent without one (chunked) is answered 413 once it passes the bound (the app then
sees the client gone), so one client cannot make the server read, parse and hold an arbitrarily large body. A body in
a content coding the server does not decode (``Content-Encoding: gzip``) is answered 415, not parsed as if plain.

After a 413 the rest of the body is read and dropped (a declared one whole if at most DRAIN_BYTES over the bound, a
chunked one up to DRAIN_BYTES more; within DRAIN_S) before the connection closes, as nginx's lingering close does:
a server that closes while the client is still sending resets the connection, and the client's TCP stack then drops
the 413 it had not read yet."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.runtime.server.errors import APIError, error_response

DEFAULT_MAX_BODY_BYTES = 16 << 20  # 16 MiB: a 128k-token prompt is under 1 MB as text or as token ids
DRAIN_BYTES = 64 << 20  # of a refused body, read and dropped past the bound; a longer one is cut off
DRAIN_S = 5.0


class BodyLimitMiddleware:
    """413 for request bodies over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> APIError:
        return APIError(413, f"the request body is larger than this server accepts ({self.max_bytes} bytes): send "
                             f"fewer or shorter prompts (kiln serve --max-body-mb raises the bound)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        coding = headers.get(b"content-encoding", b"").strip().lower()
        if coding not in (b"", b"identity"):
            unsupported = APIError(415, f"Content-Encoding {coding.decode(errors='replace')!r} is not supported: send "
                                        f"the body uncompressed")
            await error_response(unsupported)(scope, receive, send)
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # refused before the app asked for the body: a client that waits for "100 Continue" never got it and
            # sends no body, so there is nothing to drain; otherwise the whole declared body is, if not too long
            waits = headers.get(b"expect", b"").strip().lower() == b"100-continue"
            short = int(declared) - self.max_bytes <= DRAIN_BYTES
            await self._refuse(receive, send, int(declared) if short and not waits else 0)
            return
        received = 0
        refused = False  # the 413 went out: whatever the app answers after it is dropped

        async def bounded_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    # the app asked for the body, so any "100 Continue" went out and the client is sending it
                    await self._refuse(receive, send, DRAIN_BYTES if message.get("more_body", False) else 0)
                    return {"type": "http.disconnect"}  # the app stops reading, as if the client had gone
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, bounded_receive, guarded_send)

    async def _refuse(self, receive: Receive, send: Send, drain_bytes: int) -> None:
        """Send the 413, which closes the connection, whole; then read and drop up to ``drain_bytes`` more of the
        body (within DRAIN_S) before the connection closes, so that the client reads the 413 instead of a reset."""
        response = error_response(self._error())
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [*response.raw_headers, (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        if drain_bytes:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_drained(receive, drain_bytes), DRAIN_S)
        await send({"type": "http.response.body", "body": b""})


async def _drained(receive: Receive, budget: int) -> None:
    """Read and drop the rest of a request's body, until it ends, the client goes or ``budget`` bytes have come."""
    dropped = 0
    while dropped <= budget:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        dropped += len(message.get("body", b""))
