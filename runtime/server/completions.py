"""/v1/completions, and what both generation routes share: a request becomes jobs; their deltas become a response
or SSE chunks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kiln.runtime.errors import InvalidRequestError, KilnError
from kiln.runtime.llm import EngineClosedError
from kiln.runtime.outputs import RequestOutput, StreamDelta
from kiln.runtime.server.errors import APIError, error_body
from kiln.runtime.server.generation import RETRY_AFTER_S, Job, ServedModel, sampling_params
from kiln.runtime.server.logprobs import (
    TextOffsets,
    TokenText,
    completion_logprobs,
    echoed_logprobs,
    top_k,
    vllm_prompt_logprobs,
)
from kiln.runtime.server.metrics import CLIENT_CLOSED_REQUEST, CLIENT_GONE, ServerMetrics
from kiln.runtime.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    Usage,
)
from kiln.runtime.server.request_id import response_id
from kiln.runtime.structured_output import StructuredOutput, StructuredOutputError

logger = logging.getLogger("kiln.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
IGNORED_FIELDS_HEADER = "Kiln-Ignored-Fields"
ABORTED_OUTPUTS_WAIT_S = 5.0  # how long a request whose client went away waits for its jobs' aborted outputs


def make_jobs(model: ServedModel, req: SamplingFields, prompts: list[list[int]], max_tokens: list[int], *,
              logprobs: int | None, prompt_logprobs: int | None,
              structured_output: StructuredOutput | None) -> list[Job]:
    """`n` jobs per prompt, in OpenAI's choice order (prompt-major), with the model's sampling defaults."""
    for name in set(req.ignored_fields()) - model.logged_ignored_fields:
        model.logged_ignored_fields.add(name)
        logger.warning("requests set %r, which this server accepts and ignores (logged once)", name)
    try:
        return [Job(ids, sampling_params(req, max_tokens=limit, index=choice, logprobs=logprobs,
                                         prompt_logprobs=prompt_logprobs, structured_output=structured_output,
                                         defaults=model.sampling_defaults))
                for ids, limit in zip(prompts, max_tokens, strict=True) for choice in range(req.n)]
    except ValueError as exc:  # a combination the fields' own checks cannot see (min_tokens above max_tokens)
        message = str(exc).removeprefix("SamplingParams.")
        field = message.split(" ", 1)[0]
        raise APIError(400, message, param=field if field in type(req).model_fields else None) from None


def requested_format(req: SamplingFields) -> StructuredOutput | None:
    """The format ``response_format`` (OpenAI) or ``structured_outputs`` (vLLM's extension, or its guided_* fields)
    asks for, compiled."""
    requested, extension = req.response_format, req.structured_outputs
    extension_name = "structured_outputs"
    if (guided := req.guided_outputs()) is not None:
        if extension is not None:
            raise APIError(400, "send structured_outputs or the guided_* fields (its names before vLLM 0.11), not "
                                "both", param="structured_outputs")
        extension, extension_name = guided, "the guided_* fields"
    if requested is not None and requested.type == "text":
        requested = None
    if requested is not None and extension is not None:
        raise APIError(400, f"send response_format or {extension_name}, not both", param="structured_outputs")
    param = "response_format" if requested is not None else "structured_outputs"
    try:
        if extension is not None:
            spec = StructuredOutput(json=extension.json_schema, json_object=bool(extension.json_object),
                                    regex=extension.regex, grammar=extension.grammar, choice=extension.choice)
        elif requested is None:
            return None
        elif requested.type == "json_object":
            spec = StructuredOutput(json_object=True)
        elif requested.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs its json_schema (name and schema)",
                           param="response_format.json_schema")
        elif requested.json_schema.json_schema is None:
            spec = StructuredOutput(json_object=True)
        else:
            spec = StructuredOutput(json=requested.json_schema.json_schema)
        _ = spec.llguidance_grammar
    except StructuredOutputError as exc:
        raise APIError(400, str(exc), param=param) from None
    return spec


def _usage(prompts: list[list[int]], outputs: list[RequestOutput]) -> Usage:
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(out.token_ids) for out in outputs)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 cached_tokens=sum(out.metrics.num_cached_tokens for out in outputs))


async def _wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the body was read already, so nothing else arrives)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(model: ServedModel, jobs: list[Job], metrics: ServerMetrics,
                   request: Request) -> list[RequestOutput] | None:
    """Every job's output, or None when the client disconnected first (its jobs are then aborted, and what they
    had processed is counted)."""
    landed: list[RequestOutput] = []

    def observe(output: RequestOutput) -> None:
        landed.append(output)
        if output.finish_reason == "abort":  # its client went away: counted as a stream's (a prompt once prefilled)
            metrics.vllm.aborted(1, len(output.prompt_token_ids) if output.token_ids else 0, len(output.token_ids))
        else:
            metrics.observe(output)

    request_ids = [uuid.uuid4().hex for _ in jobs]
    runner = asyncio.create_task(model.generate_final(jobs, observe, request_ids))
    watcher = asyncio.create_task(_wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({runner, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not runner.done():
            for request_id in request_ids:  # each ends with its tokens so far, which observe counts
                model.llm.abort(request_id)
            with contextlib.suppress(Exception):  # as the abort's deltas land; else cancelled, which aborts too
                await asyncio.wait_for(asyncio.shield(runner), ABORTED_OUTPUTS_WAIT_S)
            runner.cancel()
    if runner not in done:
        metrics.vllm.aborted(len(jobs) - len(landed))
        return None
    try:
        return runner.result()
    except KilnError as exc:
        raise _generation_failed(exc) from None


def _generation_failed(exc: Exception) -> APIError:
    """The error of a request the engine did not finish: 503 (retry elsewhere) when the engine stopped or the server
    is shutting down, 400 when the request itself could not go on (its format outgrew llguidance's limits), 500 for
    anything else (a bug)."""
    status = 503 if isinstance(exc, EngineClosedError) else 400 if isinstance(exc, InvalidRequestError) else 500
    return APIError(status, f"generation failed: {exc}", headers={"Retry-After": str(RETRY_AFTER_S)} if status == 503
                    else None)


class _EventStream(Response):
    """Server-sent events that always release the request's admission and abort its jobs, however the stream
    ends (finished, client gone, server shutting down). Leaner than Starlette's StreamingResponse (no anyio task
    group per response): one task watches for the client going away and cancels the writer."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None], headers: dict[str, str]) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **headers})
        self._content = content
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.current_task()
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        watcher.add_done_callback(lambda task: task.cancelled() or writer.cancel())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for text in self._content:
                await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # cancelled from outside (the server stopping): not the client going away
            writer.uncancel()
            scope[CLIENT_GONE] = True
        finally:
            watcher.cancel()
            self._release()
            await self._content.aclose()


def _event(data: dict) -> str:
    """One server-sent event; a typed one (the Responses API's) names its type in an ``event:`` line too."""
    name = f"event: {data['type']}\n" if "type" in data else ""
    return f"{name}data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _error_chunk(failed: APIError) -> dict:
    return error_body(failed.status_code, failed.message)


@dataclass
class StreamEvents:
    """What a streamed response sends: the ``prelude`` chunks first, ``render``'s chunks for each delta, the
    ``usage`` chunk last (when ``with_usage``: the request asked for it), the ``error`` chunk instead for a
    failure mid-stream, and then ``done`` (chat and completions end with OpenAI's ``data: [DONE]``)."""

    render: Callable[[int, StreamDelta], list[dict]]
    usage: Callable[[Usage], dict]
    prelude: list[dict] = field(default_factory=list)
    with_usage: bool = False
    error: Callable[[APIError], dict] = _error_chunk
    done: str = "data: [DONE]\n\n"


async def _sse(model: ServedModel, jobs: list[Job], metrics: ServerMetrics, prompts: list[list[int]],
               stream: StreamEvents) -> AsyncIterator[str]:
    """The SSE body (``StreamEvents`` says what it holds). The chunks of deltas that arrived together go out in one
    write."""
    outputs: list[RequestOutput] = []
    generated: dict[int, int] = {}  # tokens so far of each job whose prompt was prefilled and that is still running
    if stream.prelude:
        yield "".join(_event(chunk) for chunk in stream.prelude)
    try:
        async with contextlib.aclosing(model.generate(jobs)) as batches:
            async for batch in batches:
                events = []
                for index, delta in batch:
                    generated[index] = generated.get(index, 0) + len(delta.token_ids)
                    if delta.finished:
                        del generated[index]
                        outputs.append(delta.output)
                        metrics.observe(delta.output)
                    events += [_event(chunk) for chunk in stream.render(index, delta)]
                if events:
                    yield "".join(events)
    except Exception as exc:  # the engine stopped (closed, or a bug in it): tell the client in the stream
        logger.error("stream failed: %s: %s", type(exc).__name__, exc)
        yield _event(stream.error(_generation_failed(exc)))
    else:
        if stream.with_usage:
            yield _event(stream.usage(_usage(prompts, outputs)))
    finally:
        if len(outputs) < len(jobs):  # the client went away (or the engine stopped) first
            metrics.vllm.aborted(len(jobs) - len(outputs), sum(len(jobs[i].prompt_token_ids) for i in generated),
                                 sum(generated.values()))
    if stream.done:
        yield stream.done


async def respond(model: ServedModel, req: SamplingFields, jobs: list[Job], prompts: list[list[int]],
                  metrics: ServerMetrics, request: Request, *,
                  build: Callable[[list[RequestOutput], Usage], BaseModel], stream: StreamEvents,
                  ignored: list[str] | None = None) -> Response:
    """The response to a generation request: an SSE stream of ``stream``'s events (its usage where the request's
    ``stream_options`` ask), or the JSON body ``build`` makes once every job is done. Either says in the
    IGNORED_FIELDS_HEADER which of the request's fields were accepted and ignored (``ignored``, default
    ``req.ignored_fields()``)."""
    release = model.admission.reserve(len(jobs))
    ignored = ", ".join(req.ignored_fields() if ignored is None else ignored)
    headers = {IGNORED_FIELDS_HEADER: ignored} if ignored else {}
    if req.stream:
        with_usage = stream.with_usage or req.stream_options is not None and req.stream_options.include_usage
        body = _sse(model, jobs, metrics, prompts, replace(stream, with_usage=with_usage))
        return _EventStream(body, release, headers)
    try:
        outputs = await _collect(model, jobs, metrics, request)
    finally:
        release()
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # built and encoded off the event loop: n = 128 choices with 20 logprobs a token take long enough to stall the
    # other requests' streams
    return await asyncio.to_thread(
        lambda: JSONResponse(build(outputs, _usage(prompts, outputs)).model_dump(mode="json"), headers=headers))


def _as_prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _echo_text(model: ServedModel, given: str | list[int], token_ids: list[int]) -> str:
    """The prompt as ``echo`` returns it: the text as sent, or the token ids decoded."""
    if isinstance(given, str):
        return given
    return model.tokenizer.decode(token_ids) if model.tokenizer is not None else ""


def _echo_offsets(model: ServedModel, given: str | list[int], token_ids: list[int]) -> list[int]:
    """Where each prompt token starts in the echoed prompt: in a text as sent, where the tokenizer found it (special
    tokens written in the text included); else in the ids' decoded text."""
    if isinstance(given, str) and model.tokenizer is not None:
        offsets = model.tokenizer.char_offsets(given)
        if len(offsets) == len(token_ids):
            return offsets
    return TextOffsets(model.tokenizer, []).take(token_ids)


def check_model(model: ServedModel, requested: str | None) -> None:
    """A 404 unless ``requested`` is unset or one of the model's names."""
    if requested is not None and requested not in model.names:
        raise APIError(404, f"The model '{requested}' does not exist: this server serves "
                            f"{', '.join(repr(name) for name in model.names)} "
                            f"(see /v1/models)", param="model", code="model_not_found")


def check_request(model: ServedModel, req: SamplingFields) -> None:
    """``check_model``, then a 400 for ``stream_options`` without ``stream`` (as OpenAI and vLLM refuse it) or for a
    token id outside the vocabulary in ``logit_bias`` or ``stop_token_ids``, naming the field."""
    check_model(model, req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true: drop it or stream the response",
                       param="stream_options")
    if req.stream and req.prompt_logprobs:  # no chunk carries them (vLLM refuses this too)
        raise APIError(400, "prompt_logprobs are not available with stream: true: drop one of them",
                       param="prompt_logprobs")
    vocab_size = model.limits.vocab_size
    for param, token_ids in (("logit_bias", req.logit_bias or {}), ("stop_token_ids", req.stop_token_ids or [])):
        if vocab_size is not None and (outside := sorted(t for t in token_ids if t >= vocab_size)):
            raise APIError(400, f"'{param}' names token ids {outside[:8]} outside this model's vocabulary of "
                                f"{vocab_size} tokens: send ids below {vocab_size}", param=param)


def stream_chunk(request_id: str, object_name: str, created: int, model_name: str, choices: list[dict],
                 usage: Usage | None = None) -> dict:
    """One SSE chunk of a streamed response."""
    return {"id": request_id, "object": object_name, "created": created, "model": model_name, "choices": choices,
            "usage": usage.model_dump() if usage else None}


async def create_completion(model: ServedModel, req: CompletionRequest, metrics: ServerMetrics,
                            request: Request) -> object:
    """Handle POST /v1/completions."""
    check_request(model, req)
    if req.best_of is not None and req.best_of < req.n:  # as OpenAI and vLLM refuse it
        raise APIError(400, f"best_of ({req.best_of}) must be greater than or equal to n ({req.n})", param="best_of")
    given = _as_prompt_list(req.prompt)
    model.admission.check_fits(len(given) * req.n, "prompt")  # before tokenizing a batch too large to run
    prompts = await model.tokenize_many(given, "prompt")
    scoring = req.max_tokens == 0  # OpenAI's echo without generation: the prompt and its log probabilities alone
    if scoring and not req.echo:
        raise APIError(400, "max_tokens 0 generates nothing: with echo: true it returns the prompt alone (and its "
                            "log probabilities with logprobs), else ask for at least 1 token", param="max_tokens")
    limits = [model.max_tokens(len(ids), 1 if scoring else req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
                               "max_tokens") for ids in prompts]  # scoring runs the prefill, its one token dropped

    def counted(usage: Usage) -> Usage:
        """The usage the client sees: a scored prompt's dropped token is no completion token."""
        return _usage(prompts, []) if scoring else usage

    echo_logprobs = req.logprobs if req.echo else None
    prompt_logprobs = max((k for k in (req.prompt_logprobs, echo_logprobs) if k is not None), default=None)
    structured_output = await asyncio.to_thread(requested_format, req)  # compiling may take a while: off the loop
    jobs = make_jobs(model, req, prompts, limits, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs,
                     structured_output=structured_output)
    model.check(jobs[::req.n], "prompt")  # one job per prompt: a prompt's n choices differ only in their seed
    request_id, created = response_id("cmpl-", request, req.request_id), int(time.time())
    chunk = functools.partial(stream_chunk, request_id, "text_completion", created, model.name)
    names = TokenText(model.tokenizer)
    echoes = [_echo_text(model, p, ids) if req.echo else "" for p, ids in zip(given, prompts, strict=True)]
    offsets = [TextOffsets(model.tokenizer, prompts[i // req.n], start=len(echoes[i // req.n]))
               for i in range(len(jobs) if req.logprobs is not None else 0)]  # where each choice's next token starts
    echoed: set[int] = set()

    def legacy(index: int, prompt_entries: list | None, entries: list | None) -> CompletionLogprobs | None:
        """The choice's next piece of the legacy logprobs: the echoed prompt's (when given), then ``entries``."""
        if req.logprobs is None:
            return None
        piece, entries = CompletionLogprobs(), entries or []
        if prompt_entries is not None:
            ids = prompts[index // req.n]
            piece = echoed_logprobs(names, ids, top_k(prompt_entries, req.logprobs),
                                    _echo_offsets(model, given[index // req.n], ids))
        more = completion_logprobs(names, entries, offsets[index].take([entry.token_id for entry in entries]))
        return piece.extend(more)

    def render(index: int, delta: StreamDelta) -> list[dict]:
        echo = ""
        if req.echo and index not in echoed:
            echoed.add(index)
            echo = echoes[index // req.n]
        text, entries = ("", None) if scoring else (delta.text, delta.logprobs)
        if not (echo or text or delta.finished or entries):
            return []
        logprobs = legacy(index, delta.prompt_logprobs if req.echo else None, entries)
        return [chunk([{"index": index, "text": echo + text, "logprobs": logprobs and logprobs.model_dump(),
                        "finish_reason": ("length" if scoring else delta.finish_reason) if delta.finished else None,
                        "stop_reason": stop_reason(delta)}])]

    def build(outputs: list[RequestOutput], usage: Usage) -> CompletionResponse:
        choices = []
        for i, out in enumerate(outputs):
            prompt_entries = out.prompt_logprobs if req.prompt_logprobs is not None else None
            choices.append(CompletionChoice(
                index=i, text=echoes[i // req.n] + ("" if scoring else out.text),
                finish_reason="length" if scoring else out.finish_reason, stop_reason=out.stop_reason,
                logprobs=legacy(i, out.prompt_logprobs if req.echo else None, None if scoring else out.logprobs),
                prompt_logprobs=None if prompt_entries is None else vllm_prompt_logprobs(
                    names, top_k(prompt_entries, req.prompt_logprobs))))
        return CompletionResponse(id=request_id, created=created, model=model.name, choices=choices,
                                  usage=counted(usage))

    return await respond(model, req, jobs, prompts, metrics, request, build=build,
                         stream=StreamEvents(render, lambda usage: chunk([], counted(usage))))


def stop_reason(delta: StreamDelta) -> int | str | None:
    """A stream's ``stop_reason`` (vLLM's): on the last delta, the stop string or token id that ended it."""
    return delta.output.stop_reason if delta.output is not None else None
