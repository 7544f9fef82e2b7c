"""JSON bodies in raw UTF-8, as vLLM and OpenAI write them: whole responses, server-sent events and errors alike."""

from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse

SURROGATE = re.compile("[\ud800-\udfff]")  # a UTF-16 surrogate: JSON can escape one alone, UTF-8 cannot carry it


def utf8_json(content: object, *, allow_nan: bool = True) -> bytes:
    """``content`` as compact JSON in UTF-8, its text raw (not ``\\u`` escapes); a lone UTF-16 surrogate, which no
    UTF-8 can carry (only a request's JSON escape brings one, echoed back), stays an escape."""
    text = json.dumps(content, ensure_ascii=False, allow_nan=allow_nan, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:  # outside strings, JSON text is ASCII: every surrogate is inside one
        return SURROGATE.sub(lambda found: f"\\u{ord(found.group()):04x}", text).encode()


class Utf8JSONResponse(JSONResponse):
    """A JSON response written by ``utf8_json``: a lone surrogate echoed back is an escape, not a 500."""

    def render(self, content: object) -> bytes:
        return utf8_json(content, allow_nan=False)
