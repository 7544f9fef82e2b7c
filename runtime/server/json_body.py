"""Request bodies parsed as JSON within bounds on their shape, so that no body under the size bound stalls the server.

Parsing holds the GIL: a 15 MiB body of millions of small arrays (``[[1]],[[1]],...``) takes seconds in ``json.loads``
and stalls every other request, on the event loop or on a worker thread alike, and validating that many objects
takes as long. So a body with more brackets than ``MAX_CONTAINERS``, or more separators than ``MAX_VALUES``, is
scanned first, outside its strings, and refused (400 naming the bound) when it holds more arrays and objects, or
more values, than that; every body is refused when it nests deeper than ``MAX_DEPTH``. A body within the bounds
costs what ``json.loads`` costs, plus a walk over its arrays and objects when it has more brackets than
``MAX_DEPTH``. Bodies over ``THREAD_THRESHOLD_BYTES`` are parsed on a worker
thread, where the scan gives the GIL up as it goes; validation stays on the event loop."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Coroutine
from json.decoder import scanstring
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

MAX_DEPTH = 128  # serde_json's recursion limit: deeper than any JSON schema a request carries
# arrays and objects: each costs several microseconds to parse and validate (a message is up to three: itself, its
# parts and a part), so this many take about half a second; a conversation of 30,000 messages fits
MAX_CONTAINERS = 100_000
# numbers, strings, keys: validating this many flat values on the event loop takes about 0.2 s (16 prompts of 128k
# token ids fit; 8M of them, what 16 MiB holds, had taken 0.7 s a request)
MAX_VALUES = 2_000_000
THREAD_THRESHOLD_BYTES = 64 << 10  # a smaller body is parsed within a millisecond or two

# a string's opening quote, an opening bracket, a closing one, a separator (before every value but a container's first,
# which its opening bracket counts)
_TOKEN = re.compile(r'"|([\[{])|([\]}])|([,:])')
TOO_DEEP = (f"the request body nests JSON arrays and objects more than {MAX_DEPTH} levels deep: send a flatter "
            f"body")
TOO_MANY = (f"the request body holds more than {MAX_CONTAINERS} JSON arrays and objects: send fewer messages, tools "
            f"or prompts per request")
TOO_MANY_VALUES = (f"the request body holds more than {MAX_VALUES} JSON values: send fewer or shorter prompts (a "
                   f"prompt sent as text is one value, as token ids one a token)")


def shape_error(text: str) -> str | None:
    """What is wrong with the shape of a JSON text (nested too deep, too many arrays and objects) as a message for its
    sender, or None; a text that is not JSON is left to the parser to say where. Brackets inside strings do not
    count."""
    depth = containers = values = pos = 0
    while (token := _TOKEN.search(text, pos)) is not None:
        pos = token.end()
        if token.lastindex is None:  # a string: what it holds is text
            try:
                pos = scanstring(text, pos)[1]
            except ValueError:
                return None
        elif token.lastindex == 2:
            depth -= 1
        else:
            values += 1
            if values > MAX_VALUES:
                return TOO_MANY_VALUES
            if token.lastindex == 1:
                depth += 1
                containers += 1
                if depth > MAX_DEPTH:
                    return TOO_DEEP
                if containers > MAX_CONTAINERS:
                    return TOO_MANY
    return None


def parse_json(body: bytes) -> Any:
    """A request body as JSON: json.JSONDecodeError where it is not JSON, HTTPException 400 where its shape passes a
    bound."""
    text = body.decode(json.detect_encoding(body), "surrogatepass")  # as json.loads decodes bytes
    brackets = text.count("[") + text.count("{")  # an upper bound on its arrays and objects, and on its depth
    could_pass = brackets > MAX_CONTAINERS or brackets + text.count(",") + text.count(":") > MAX_VALUES
    if could_pass and (problem := shape_error(text)) is not None:
        raise HTTPException(400, problem)  # before parsing what would take seconds
    try:
        value = json.loads(text)
    except RecursionError:
        raise HTTPException(400, TOO_DEEP) from None
    if brackets > MAX_DEPTH and _deeper_than(value, MAX_DEPTH):
        raise HTTPException(400, TOO_DEEP)
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether parsed JSON nests its arrays and objects more than ``limit`` levels deep."""
    stack = [(value, 1)] if isinstance(value, list | dict) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)
                     if isinstance(child, list | dict))
    return False


class JSONBodyRequest(Request):
    """A request whose JSON body is parsed by ``parse_json``, on a worker thread when it is large."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            large = len(body) > THREAD_THRESHOLD_BYTES
            self._json = await asyncio.to_thread(parse_json, body) if large else parse_json(body)
        return self._json


class JSONBodyRoute(APIRoute):
    """An API route that reads its JSON body as a ``JSONBodyRequest`` (FastAPI's custom request class pattern)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_bounded(request: Request) -> Response:
            return await handle(JSONBodyRequest(request.scope, request.receive))

        return handle_bounded
