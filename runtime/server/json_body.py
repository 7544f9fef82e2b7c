"""Request bodies parsed as JSON within bounds on their shape, so that no body under the size bound stalls the server.

Parsing holds the GIL: a 15 MiB body of millions of small arrays (``[[1]],[[1]],...``) takes seconds in ``json.loads``
and stalls every other request, on the event loop or on a worker thread alike. So the shape is checked first, outside
strings, with the C string methods where that settles it and otherwise in one pass that stops at the first bound
passed: depth (``MAX_DEPTH``), arrays and objects (``MAX_CONTAINERS``) and values (``MAX_VALUES``); a body past one is
answered 400 naming it, and one within them is parsed and validated in a fraction of a second (about 0.2 s at most,
measured on the routes' models). Bodies over ``THREAD_THRESHOLD_BYTES`` are checked and parsed on a worker thread,
where the pass gives the GIL up as it goes; validation stays on the event loop, bounded by the same limits."""

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
MAX_CONTAINERS = 20_000  # arrays and objects: each costs several microseconds to parse and validate (a message, say)
MAX_VALUES = 500_000  # numbers, strings, keys: a prompt sent as token ids is one value a token
THREAD_THRESHOLD_BYTES = 64 << 10  # a smaller body is checked and parsed within about 5 ms

# a string's opening quote, an opening bracket, a closing one, a separator (before every value but a container's first,
# which its opening bracket counts)
_TOKEN = re.compile(r'"|([\[{])|([\]}])|([,:])')


def shape_error(text: str) -> str | None:
    """What is wrong with the shape of a JSON text (nested too deep, too many arrays and objects, too many values), as
    a message for its sender, or None; a text that is not JSON is left to the parser to say where."""
    containers = text.count("[") + text.count("{")
    if containers <= MAX_DEPTH and containers + text.count(",") + text.count(":") <= MAX_VALUES:
        return None  # within every bound even counting the brackets and separators strings hold
    depth = containers = values = pos = 0
    while (token := _TOKEN.search(text, pos)) is not None:
        pos = token.end()
        kind = token.lastindex
        if kind is None:  # a string: what it holds is text
            try:
                pos = scanstring(text, pos)[1]
            except ValueError:
                return None
            continue
        if kind == 2:
            depth -= 1
            continue
        values += 1
        if values > MAX_VALUES:
            return (f"the request body holds more than {MAX_VALUES} JSON values: send fewer or shorter prompts (a "
                    f"prompt sent as text is one value, as token ids one a token)")
        if kind == 1:
            depth += 1
            containers += 1
            if depth > MAX_DEPTH:
                return (f"the request body nests JSON arrays and objects more than {MAX_DEPTH} levels deep: send a "
                        f"flatter body")
            if containers > MAX_CONTAINERS:
                return (f"the request body holds more than {MAX_CONTAINERS} JSON arrays and objects: send fewer "
                        f"messages, tools or prompts per request")
    return None


def parse_json(body: bytes) -> Any:
    """A request body as JSON: json.JSONDecodeError where it is not JSON, HTTPException 400 where its shape passes a
    bound."""
    text = body.decode(json.detect_encoding(body), "surrogatepass")  # as json.loads decodes bytes
    problem = shape_error(text)
    if problem is not None:
        raise HTTPException(400, problem)
    return json.loads(text)


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
