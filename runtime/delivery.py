"""Where a request's outputs go: a thread's future, or an asyncio caller's callback run on its own event loop, with
one hop per loop per engine step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kiln.runtime.outputs import StreamDelta

logger = logging.getLogger("kiln.runtime")


@dataclass
class Sink:
    """Where a request's deltas and final output go: a thread's ``future``, or ``push``, called on ``loop`` with
    each delta (and with the error that ends the request) for an asyncio caller."""

    future: Future = field(default_factory=Future)
    loop: asyncio.AbstractEventLoop | None = None
    push: Callable[[StreamDelta | BaseException], None] | None = None
    every_delta: bool = True  # False: push the final delta only
    prompt: str | None = None  # the prompt's text, which the final output carries (RequestOutput.prompt)


ABORTING = Sink()  # the sink of a request abort_all failed, until the engine's final delta for it


class Outbox:
    """What one engine iteration hands to asyncio callers, grouped by event loop: each loop is woken once per step,
    however many of its requests the step advanced."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, Callable, object]]] = {}

    def add(self, request_id: str, sink: Sink, item: StreamDelta | BaseException) -> None:
        self._by_loop.setdefault(sink.loop, []).append((request_id, sink.push, item))

    def flush(self) -> list[str]:
        """Send what was added; returns the requests whose event loop is gone (nobody listens to them any more)."""
        orphans = []
        for loop, items in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(push_all, items)
            except RuntimeError:  # the loop was closed
                orphans += [request_id for request_id, _, _ in items]
        self._by_loop.clear()
        return orphans


def push_all(items: list[tuple[str, Callable, object]]) -> None:
    """Hand each item to its request's callback, on the callbacks' event loop."""
    for request_id, push, item in items:
        try:
            push(item)
        except Exception:  # a caller's callback (stream_many's on_finished): the other requests still get theirs
            logger.exception("delivering request %s's output raised", request_id)


def settle(future: asyncio.Future, item: StreamDelta | BaseException) -> None:
    """Complete an asyncio future with a final delta's output or an error, unless its task was cancelled."""
    if future.done():
        return
    if isinstance(item, BaseException):
        future.set_exception(item)
    elif item.finished:
        future.set_result(item.output)
