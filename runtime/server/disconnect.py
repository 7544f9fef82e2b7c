"""A client that goes away ends the work done for it: the ASGI ``http.disconnect`` Kiln's routes watch for, and
``with_cancellation``, which gives an embedder's routes the same (Starlette runs a handler to its end whether or not
its client is still there)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from kiln.runtime.server.metrics import CLIENT_CLOSED_REQUEST

P = ParamSpec("P")
T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the body was read already, so nothing else arrives)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def done_before_disconnect(work: asyncio.Future, receive: Receive) -> bool:
    """Wait for ``work`` or the client's going away, whichever comes first; whether ``work`` is done. The caller ends
    work that is not (its own way: an abort, a cancel), in a ``finally`` that a cancelled wait runs too."""
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    return work.done()


def with_cancellation(handler: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T | Response]]:
    """Decorate an async route handler that takes a ``Request`` (``request: fastapi.Request``), as vLLM's
    ``with_cancellation``: once its client disconnects the handler is cancelled, so that the ``generate_async`` it
    awaits aborts its request and frees the KV blocks at once, and the route answers 499 (nobody reads it)."""

    @functools.wraps(handler)
    async def cancellable(*args: P.args, **kwargs: P.kwargs) -> T | Response:
        request = next((arg for arg in (*args, *kwargs.values()) if isinstance(arg, Request)), None)
        if request is None:
            raise TypeError(f"{handler.__qualname__} takes no Request, which with_cancellation watches for the client "
                            f"going away: give it a parameter `request: fastapi.Request`")
        await request.body()  # kept by the request for the handler: the watcher below reads only the disconnect
        work = asyncio.ensure_future(handler(*args, **kwargs))
        try:
            await done_before_disconnect(work, request.receive)
        finally:
            if not work.done():  # the client went away (or the server is stopping): the handler ends first
                work.cancel()
                await asyncio.wait({work})
        if work.cancelled():
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return work.result()

    return cancellable
