"""``kiln.runtime.logs.JsonLinesFormatter``: ``--log-config``'s JSON lines, one object a line whatever a message or a
traceback holds."""

from __future__ import annotations

import io
import json
import logging

from kiln.runtime.logs import JsonLinesFormatter
from kiln.runtime.server.request_id import REQUEST_ID, RequestIdFilter


def test_each_record_is_one_json_line_with_its_request_id_and_traceback():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLinesFormatter())
    handler.addFilter(RequestIdFilter())
    logger = logging.getLogger("kiln.test.json_lines")
    logger.addHandler(handler)
    logger.propagate = False
    token = REQUEST_ID.set("job-9")
    try:
        logger.warning('127.0.0.1 - "GET /health HTTP/1.1" %d', 200)  # uvicorn's access line: quotes
        try:
            raise ZeroDivisionError("division by zero")
        except ZeroDivisionError:
            logger.exception("step failed")
    finally:
        REQUEST_ID.reset(token)
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == '127.0.0.1 - "GET /health HTTP/1.1" 200' and first["level"] == "WARNING"
    assert first["request_id"] == "job-9" and first["logger"] == "kiln.test.json_lines" and "T" in first["time"]
    assert second["message"] == "step failed" and "ZeroDivisionError" in second["exception"]
