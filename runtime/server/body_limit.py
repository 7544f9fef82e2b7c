"""A bound on request bodies, applied before anything parses them: a declared ``Content-Length`` over the bound is
answered 413 at once, and a body sent without one (chunked) is answered 413 once it passes the bound (the app then
sees the client gone), so one client cannot make the server read, parse and hold an arbitrarily large body. A body in
a content coding the server does not decode (``Content-Encoding: gzip``) is answered 415, not parsed as if plain.
Like any answer sent before the body ended, a 413 closes its connection once the rest of the body is read and
dropped (``http_protocol``), so that the client reads it, not a reset."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.runtime.server.errors import APIError, error_response

DEFAULT_MAX_BODY_BYTES = 16 << 20  # 16 MiB: a 128k-token prompt is under 1 MB as text or as token ids


class BodyLimitMiddleware:
    """413 for request bodies over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> APIError:
        return APIError(413, f"the request body is larger than this server accepts ({self.max_bytes} bytes): send "
                             f"fewer or shorter prompts (kiln serve --max-body-mb raises the bound)",
                        headers={"connection": "close"})  # never reused: h11 (no httptools) would read it all

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
            await error_response(self._error())(scope, receive, send)
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
                    await error_response(self._error())(scope, receive, send)
                    return {"type": "http.disconnect"}  # the app stops reading, as if the client had gone
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, bounded_receive, guarded_send)
