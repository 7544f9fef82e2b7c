"""What crosses the pipe between ``ProcessEngine`` and its child, as JSON: requests and commands one way; each
step's deltas and failures, stats, and the load handshake the other. Nothing is pickled."""

from __future__ import annotations

import contextlib
import importlib
import json
from dataclasses import asdict
from multiprocessing.connection import Connection

from kiln.runtime.errors import KilnError
from kiln.runtime.outputs import (
    RequestFailedError,
    RequestFailure,
    RequestMetrics,
    RequestOutput,
    StreamDelta,
    TokenLogprob,
)
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence


def send(conn: Connection, message: dict) -> None:
    """Write one message."""
    conn.send_bytes(json.dumps(message, separators=(",", ":")).encode())


def receive(conn: Connection) -> dict:
    """Read one message; EOFError once the other side has gone."""
    return json.loads(conn.recv_bytes())


def request_to_wire(seq: Sequence) -> list:
    params = asdict(seq.params)
    params["logit_bias"] = list(seq.params.logit_bias.items())  # JSON object keys would be strings
    return [seq.request_id, seq.prompt_token_ids, params, seq.arrival_time]


def request_from_wire(item: list) -> Sequence:
    request_id, prompt_token_ids, params, arrival_time = item
    params["logit_bias"] = dict(params["logit_bias"])
    return Sequence(request_id, prompt_token_ids, SamplingParams(**params), arrival_time=arrival_time)


def result_to_wire(result: StreamDelta | RequestFailure) -> list:
    """A step's delta, ``["d", id, text, token_ids, finished, finish_reason, output, logprobs, prompt_logprobs]``,
    or a failure,
    ``["f", id, error]``."""
    if isinstance(result, RequestFailure):
        return ["f", result.request_id, error_to_wire(result.error)]
    output = result.output
    if output is not None:
        output = [output.prompt_token_ids, output.text, output.token_ids, output.finish_reason, asdict(output.metrics),
                  _logprobs_to_wire(output.logprobs), _logprobs_to_wire(output.prompt_logprobs), output.stop_reason]
    return ["d", result.request_id, result.text, result.token_ids, result.finished, result.finish_reason, output,
            _logprobs_to_wire(result.logprobs), _logprobs_to_wire(result.prompt_logprobs)]


def result_from_wire(item: list) -> StreamDelta | RequestFailure:
    if item[0] == "f":
        return RequestFailure(item[1], error_from_wire(item[2], default=RequestFailedError))
    _, request_id, text, token_ids, finished, finish_reason, output, logprobs, prompt_logprobs = item
    if output is not None:
        prompt_ids, full_text, output_token_ids, output_reason, metrics, output_lps, prompt_lps, stopped_by = output
        output = RequestOutput(request_id, prompt_ids, full_text, output_token_ids, output_reason,
                               RequestMetrics(**metrics), logprobs=_logprobs_from_wire(output_lps),
                               prompt_logprobs=_logprobs_from_wire(prompt_lps), stop_reason=stopped_by)
    return StreamDelta(request_id, text, token_ids, finished, finish_reason, output, _logprobs_from_wire(logprobs),
                       _logprobs_from_wire(prompt_logprobs))


def _logprobs_to_wire(logprobs: list[TokenLogprob | None] | None) -> list | None:
    return None if logprobs is None else [None if lp is None else lp.to_wire() for lp in logprobs]


def _logprobs_from_wire(items: list | None) -> list | None:
    return None if items is None else [None if item is None else TokenLogprob.from_wire(item) for item in items]


def error_to_wire(error: BaseException) -> dict:
    return {"module": type(error).__module__, "name": type(error).__qualname__, "message": str(error)}


def error_from_wire(wire: dict, default: type[KilnError]) -> KilnError:
    """The error the child raised, as the same class when it is one of Kiln's own errors, else ``default`` with the
    class named in the message (only ``kiln.`` modules are imported, and only ``KilnError`` classes are built)."""
    error_class = None
    if wire["module"].startswith("kiln."):
        try:
            error_class = getattr(importlib.import_module(wire["module"]), wire["name"], None)
        except ImportError:
            error_class = None
    if isinstance(error_class, type) and issubclass(error_class, KilnError):
        with contextlib.suppress(TypeError):  # a class whose constructor takes more than a message
            return error_class(wire["message"])
    return default(f"{wire['name']}: {wire['message']}")
