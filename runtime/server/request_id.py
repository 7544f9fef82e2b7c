"""An ``x-request-id`` on every response, as OpenAI's API sends it (the openai client reads it as ``_request_id``):
the client's own ``X-Request-Id`` when it sent one that is safe to echo, else a new ``req_...`` id. The id is the
request's in Kiln's log lines too (``RequestIdFilter``)."""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("kiln.server")

REQUEST_ID_HEADER = b"x-request-id"
CLIENT_REQUEST_ID = "kiln.client_request_id"  # set in the ASGI scope: the client's own id, when it is echoed
# echoed as vLLM echoes it, where it is safe in a header, a JSON string and a log line: visible ASCII, no space
_SAFE_ID = re.compile(rb"[\x21-\x7e]{1,512}")
REQUEST_ID: ContextVar[str] = ContextVar("kiln_request_id", default="-")  # the id of the request being served


class RequestIdFilter(logging.Filter):
    """Gives each log record the ``request_id`` of the request it was logged while serving ("-" outside one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def response_id(prefix: str, request: Request, given: str | None = None) -> str:
    """A response's ``id``: ``prefix`` and the request's own id, as vLLM names its responses (logs and traces then
    match): an ``X-Request-Id`` header that is safe to echo, else ``given`` (the body's ``request_id``), else a new
    one. A body's id safe to echo becomes the request's id (``REQUEST_ID``: its log lines, its engine ids and its
    ``x-request-id`` header), as a header's is."""
    if (header := request.scope.get(CLIENT_REQUEST_ID)) is not None:
        return f"{prefix}{header}"
    if given and _SAFE_ID.fullmatch(given.encode()):
        REQUEST_ID.set(given)
    return f"{prefix}{given or uuid.uuid4().hex}"


class RequestIdMiddleware:
    """Adds ``x-request-id`` to every HTTP response, and sets ``REQUEST_ID`` while the request is served."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.logged_replaced = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # the first, as Starlette's request.headers.get (vLLM's) reads a repeated header
        given = next((value for name, value in scope["headers"] if name == REQUEST_ID_HEADER), None)
        echoed = given if given is not None and _SAFE_ID.fullmatch(given) else None
        request_id = echoed or f"req_{uuid.uuid4().hex}".encode()
        # not reset: the request's task ends with it, and the handler of unhandled errors (outside) logs with it
        REQUEST_ID.set(request_id.decode())
        if echoed is not None:
            scope[CLIENT_REQUEST_ID] = echoed.decode()
        elif given is not None and not self.logged_replaced:
            self.logged_replaced = True
            logger.warning("X-Request-Id %r is not echoed (not 1 to 512 visible ASCII characters): responses carry "
                           "a new req_ id instead (logged once)", given[:80])

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":  # the id response_id took from the body, where it did
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER, REQUEST_ID.get().encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)
