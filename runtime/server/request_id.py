"""An ``x-request-id`` on every response, as OpenAI's API sends it (the openai client reads it as ``_request_id``):
the client's own ``X-Request-Id`` when it sent one that is safe to echo, else a new ``req_...`` id."""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"
CLIENT_REQUEST_ID = "kiln.client_request_id"  # set in the ASGI scope: the client's own id, when it is echoed
_SAFE_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")  # echoed into a header: no separators, no control characters


def response_id(prefix: str, request: Request, given: str | None = None) -> str:
    """A response's ``id``: ``prefix`` and the request's own id, as vLLM names its responses (logs and traces then
    match): ``given`` (the body's ``request_id``), else an ``X-Request-Id`` header that is safe to echo, else a new
    one."""
    return f"{prefix}{given or request.scope.get(CLIENT_REQUEST_ID) or uuid.uuid4().hex}"


class RequestIdMiddleware:
    """Adds ``x-request-id`` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER)
        if given is not None and _SAFE_ID.fullmatch(given):
            request_id = given
            scope[CLIENT_REQUEST_ID] = given.decode()
        else:
            request_id = f"req_{uuid.uuid4().hex}".encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER, request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)
