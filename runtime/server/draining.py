"""Connections close while the server drains: each response then says ``Connection: close``, so a client that
pools connections (the openai SDK retrying a 503, an L4 load balancer) opens its next one afresh, where it can reach
another replica, instead of retrying this one over the kept-alive connection until it exits."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class CloseWhileDrainingMiddleware:
    """``Connection: close`` on every HTTP response that starts while ``draining()`` is true."""

    def __init__(self, app: ASGIApp, draining: Callable[[], bool]) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.draining():
                kept = [(name, value) for name, value in message.get("headers", ()) if name.lower() != b"connection"]
                message = {**message, "headers": [*kept, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)
