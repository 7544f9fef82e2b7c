"""How a generation request's jobs become its response: the JSON body once every job is done, or server-sent
events as the deltas arrive; either way the request's admission is released and a client that goes away has its
jobs aborted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kiln.runtime.errors import EngineClosedError, InvalidRequestError, KilnError
from kiln.runtime.outputs import RequestOutput, StreamDelta
from kiln.runtime.server.disconnect import done_before_disconnect, wait_for_disconnect
from kiln.runtime.server.errors import APIError, error_body
from kiln.runtime.server.generation import RETRY_AFTER_S, Job, ServedModel, engine_request_ids
from kiln.runtime.server.metrics import CLIENT_CLOSED_REQUEST, CLIENT_GONE, ServerMetrics
from kiln.runtime.server.protocol import SamplingFields, Usage
from kiln.runtime.server.utf8_json import Utf8JSONResponse, utf8_json
from kiln.runtime.structured_output import StructuredOutputError

logger = logging.getLogger("kiln.server")

IGNORED_FIELDS_HEADER = "Kiln-Ignored-Fields"
HEADER_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-\[\]]{1,100}")  # a field's name (messages[].id), or a template variable's
MAX_IGNORED_NAMES = 32
ABORTED_OUTPUTS_WAIT_S = 5.0  # how long a request whose client went away waits for its jobs' aborted outputs


def usage_of(prompts: list[list[int]], outputs: list[RequestOutput]) -> Usage:
    """The usage of a response: every prompt once, each output's tokens, and what the prefix cache held."""
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(out.token_ids) for out in outputs)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 cached_tokens=sum(out.metrics.num_cached_tokens for out in outputs))


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict:
    """A streamed choice's usage so far, as vLLM's continuous_usage_stats gives it in each chunk."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _collect(model: ServedModel, jobs: list[Job], metrics: ServerMetrics, request: Request,
                   format_param: str | None) -> list[RequestOutput] | None:
    """Every job's output, or None when the client disconnected first (its jobs are then aborted, and counted as
    aborts); jobs a failure ended are counted as aborted too (``format_param``: ``_generation_failed``'s)."""
    landed: list[RequestOutput] = []

    def observe(output: RequestOutput) -> None:
        landed.append(output)
        if output.finish_reason == "abort":  # its client went away: counted as a stream's
            metrics.vllm.aborted(1)
        else:
            metrics.observe(output)

    request_ids = engine_request_ids(len(jobs))
    runner = asyncio.create_task(model.generate_final(jobs, observe, request_ids))
    try:
        finished = await done_before_disconnect(runner, request.receive)
    finally:
        if not runner.done():
            for request_id in request_ids:  # each ends with an output of reason abort, which observe counts
                model.llm.abort(request_id)
            with contextlib.suppress(Exception):  # as the abort's deltas land; else cancelled, which aborts too
                await asyncio.wait_for(asyncio.shield(runner), ABORTED_OUTPUTS_WAIT_S)
            runner.cancel()
    if not finished:
        metrics.vllm.aborted(len(jobs) - len(landed))
        logger.info("aborted: the client went away before the answer was done")
        return None
    try:
        return runner.result()
    except KilnError as exc:  # the engine stopped, the shutdown timeout ran out, or the request failed
        _count_unfinished(metrics, len(jobs) - len(landed), exc)
        raise _generation_failed(exc, format_param) from None


def _count_unfinished(metrics: ServerMetrics, count: int, failure: Exception | None) -> None:
    """Count jobs that ended without an output: as aborts where their client went away (no ``failure``) or the
    engine stopped (a stopped engine, the shutdown timeout: EngineClosedError), else as errors, vLLM V1's finish
    reason for a request that failed (its format could not go on, an error in the engine)."""
    if failure is None or isinstance(failure, EngineClosedError):
        metrics.vllm.aborted(count)
    else:
        metrics.vllm.failed(count)


def _generation_failed(exc: Exception, format_param: str | None) -> APIError:
    """The error of a request the engine did not finish: 503 (retry elsewhere) when the engine stopped or the server
    is shutting down, 400 when the request itself could not go on (its format outgrew llguidance's limits: the 400
    names ``format_param``, the field that asked for it), 500 for anything else (a bug)."""
    status = 503 if isinstance(exc, EngineClosedError) else 400 if isinstance(exc, InvalidRequestError) else 500
    return APIError(status, f"generation failed: {exc}", headers={"Retry-After": str(RETRY_AFTER_S)} if status == 503
                    else None, param=format_param if isinstance(exc, StructuredOutputError) else None)


class _EventStream(Response):
    """Server-sent events that always release the request's admission and abort its jobs, however the stream
    ends (finished, client gone, server shutting down). Leaner than Starlette's StreamingResponse (no anyio task
    group per response): one task watches for the client going away and cancels the writer. ``generated``: how many
    tokens the jobs have generated so far, for the log line of a client gone."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None], headers: dict[str, str],
                 generated: Callable[[], int]) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **headers})
        self._content = content
        self._release = release
        self._generated = generated

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.current_task()
        watcher = asyncio.create_task(wait_for_disconnect(receive))
        watcher.add_done_callback(lambda task: task.cancelled() or writer.cancel())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for body in self._content:
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # cancelled from outside (the server stopping): not the client going away
            writer.uncancel()
            scope[CLIENT_GONE] = True
            if tokens := self._generated():
                logger.info("aborted: the client went away mid-stream, after %d generated tokens", tokens)
            else:
                logger.info("aborted: the client went away before the first token (queued, or in prefill)")
        finally:
            watcher.cancel()
            self._release()
            await self._content.aclose()


def _event(data: dict) -> bytes:
    """One server-sent event, its JSON as a whole response's (``utf8_json``); a typed one (the Responses API's)
    names its type in an ``event:`` line too."""
    name = f"event: {data['type']}\n".encode() if "type" in data else b""
    return b"%sdata: %s\n\n" % (name, utf8_json(data))


def _error_chunk(failed: APIError) -> list[dict]:
    return [error_body(failed.status_code, failed.message, failed.param, failed.code, failed.kind)]


@dataclass
class StreamEvents:
    """What a streamed response sends: the ``prelude`` chunks first, ``render``'s chunks for each delta (a choice's
    ``opening`` chunks before those of its first delta, in the same write), the ``usage`` chunk last (when
    ``with_usage``: the request asked for it), the ``error`` chunks instead for a failure mid-stream, and then
    ``done`` (chat and completions end with OpenAI's ``data: [DONE]``)."""

    render: Callable[[int, StreamDelta], list[dict]]
    usage: Callable[[Usage], dict]
    prelude: list[dict] = field(default_factory=list)
    opening: Callable[[int], list[dict]] | None = None  # a choice's chunks before its tokens (chat's role chunk)
    with_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: each chunk of a choice with its usage so far
    generates: bool = True  # False: a scored prompt's (echo, max_tokens 0), whose one token is no completion token
    error: Callable[[APIError], list[dict]] = _error_chunk
    done: bytes = b"data: [DONE]\n\n"


def _with_usage(opening: list[dict], chunks: list[dict], prompt_tokens: int, generated: int,
                new: int) -> tuple[list[dict], list[dict]]:
    """A choice's chunks of one delta with their usage so far, as vLLM's continuous_usage_stats counts it: the
    opening chunks before the delta's ``new`` tokens, the first of the delta's chunks with them, and none on the
    chunks it was split into after that (a finish after tool calls), so that the count rises from chunk to chunk."""
    before = usage_so_far(prompt_tokens, generated - new)
    after = usage_so_far(prompt_tokens, generated)
    return ([{**chunk, "usage": before} for chunk in opening],
            [{**chunk, "usage": after} for chunk in chunks[:1]] + chunks[1:])


async def _sse(model: ServedModel, jobs: list[Job], metrics: ServerMetrics, prompts: list[list[int]],
               stream: StreamEvents, release: Callable[[], None], format_param: str | None,
               generated: dict[int, int]) -> AsyncIterator[bytes]:
    """The SSE body (``StreamEvents`` says what it holds). The chunks of deltas that arrived together go out in one
    write. The request's admission is released once the engine is done with its jobs, though a client that does not
    read has not taken their last chunks yet. ``generated``: filled with the tokens so far of each job whose prompt
    was prefilled."""
    outputs: list[RequestOutput] = []
    failure: Exception | None = None
    if stream.prelude:
        yield b"".join(_event(chunk) for chunk in stream.prelude)
    try:
        async with contextlib.aclosing(model.generate(jobs, on_finished=release)) as batches:
            async for batch in batches:
                events = []
                for index, delta in batch:
                    opening = stream.opening(index) if stream.opening and index not in generated else []
                    generated[index] = generated.get(index, 0) + len(delta.token_ids)
                    if delta.finished:
                        outputs.append(delta.output)
                        metrics.observe(delta.output)
                    chunks = stream.render(index, delta)
                    if stream.continuous_usage:
                        new = len(delta.token_ids) if stream.generates else 0
                        opening, chunks = _with_usage(opening, chunks, len(jobs[index].prompt_token_ids),
                                                      generated[index] if stream.generates else 0, new)
                    events += [_event(chunk) for chunk in opening + chunks]
                if events:
                    yield b"".join(events)
    except Exception as exc:  # the engine stopped (closed, or a bug in it), or the request could not go on (its
        # format): tell the client in the stream
        failure, failed = exc, _generation_failed(exc, format_param)
        logger.log(logging.ERROR if failed.status_code >= 500 else logging.INFO, "stream failed: %s: %s",
                   type(exc).__name__, exc)
        yield b"".join(map(_event, stream.error(failed)))
    else:
        if stream.with_usage:
            yield _event(stream.usage(usage_of(prompts, outputs)))
    finally:
        if len(outputs) < len(jobs):  # the client went away, the engine stopped or the request failed first
            _count_unfinished(metrics, len(jobs) - len(outputs), failure)
    if stream.done:
        yield stream.done


async def respond(model: ServedModel, req: SamplingFields, jobs: list[Job], prompts: list[list[int]],
                  metrics: ServerMetrics, request: Request, *,
                  build: Callable[[list[RequestOutput], Usage], BaseModel], stream: StreamEvents,
                  ignored: list[str] | None = None, format_param: str | None = None) -> Response:
    """The response to a generation request: an SSE stream of ``stream``'s events (its usage where the request's
    ``stream_options`` ask), or the JSON body ``build`` makes once every job is done. Either says in the
    IGNORED_FIELDS_HEADER which of the request's fields were accepted and ignored (``ignored``, default
    ``req.ignored_fields()``); an output format that cannot go on is a 400 naming ``format_param`` (the field that
    asked for it)."""
    ignored = ignored_header(req.ignored_fields() if ignored is None else ignored)
    headers = {IGNORED_FIELDS_HEADER: ignored} if ignored else {}
    release = model.admission.reserve(len(jobs))
    for job in jobs[::req.n]:  # each prompt's first choice: vLLM counts a prompt of a batch as a request
        metrics.vllm.requested(req.n, job.params.max_tokens)
    if req.stream:
        options = req.stream_options
        with_usage = stream.with_usage or includes_usage(req)
        continuous = with_usage and options is not None and bool(options.continuous_usage_stats)
        generated: dict[int, int] = {}
        body = _sse(model, jobs, metrics, prompts, replace(stream, with_usage=with_usage, continuous_usage=continuous),
                    release, format_param, generated)
        return _EventStream(body, release, headers, lambda: sum(generated.values()))
    try:
        outputs = await _collect(model, jobs, metrics, request, format_param)
    finally:
        release()
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # built and encoded off the event loop: n = 128 choices with 20 logprobs a token take long enough to stall the
    # other requests' streams
    return await asyncio.to_thread(
        lambda: Utf8JSONResponse(build(outputs, usage_of(prompts, outputs)).model_dump(mode="json"), headers=headers))


def ignored_header(names: list[str]) -> str:
    """The IGNORED_FIELDS_HEADER value naming ``names``: only names a header can carry (a client's
    chat_template_kwargs key may hold anything; no template reads one that is not a name), at most
    MAX_IGNORED_NAMES of them, "..." standing for the rest."""
    fit = [name for name in names if HEADER_SAFE_NAME.fullmatch(name)]
    return ", ".join(fit[:MAX_IGNORED_NAMES] + (["..."] if len(fit) > MAX_IGNORED_NAMES else []))


def includes_usage(req: SamplingFields) -> bool:
    """Whether a streamed request asked for its usage (``stream_options.include_usage``)."""
    return req.stream_options is not None and req.stream_options.include_usage


def stream_chunk(request_id: str, object_name: str, created: int, model_name: str, choices: list[dict],
                 usage: Usage | None = None, *, with_usage: bool = False) -> dict:
    """One SSE chunk of a streamed response: its ``usage`` null until the last chunk where the request asked for
    it (``with_usage``, ``includes_usage``), else no ``usage`` key, as OpenAI and vLLM send chunks."""
    chunk = {"id": request_id, "object": object_name, "created": created, "model": model_name, "choices": choices}
    return {**chunk, "usage": usage.model_dump() if usage else None} if with_usage or usage else chunk


def stop_reason(delta: StreamDelta) -> int | str | None:
    """A stream's ``stop_reason`` (vLLM's): on the last delta, the stop string or token id that ended it."""
    return delta.output.stop_reason if delta.output is not None else None
