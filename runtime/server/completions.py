"""/v1/completions: prompts (text or token ids, one or a batch) completed, with the legacy logprobs, echo and
scoring (``max_tokens`` 0)."""

from __future__ import annotations

import functools
import time

from starlette.requests import Request

from kiln.runtime.outputs import RequestOutput, StreamDelta
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.generation import ServedModel
from kiln.runtime.server.jobs import (
    check_request,
    compiled_format,
    computed_prompt_logprobs,
    format_field,
    make_jobs,
)
from kiln.runtime.server.logprobs import (
    TextOffsets,
    TokenText,
    completion_logprobs,
    echoed_logprobs,
    top_k,
    vllm_prompt_logprobs,
)
from kiln.runtime.server.metrics import ServerMetrics
from kiln.runtime.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from kiln.runtime.server.request_id import response_id
from kiln.runtime.server.responding import (
    StreamEvents,
    includes_usage,
    respond,
    stop_reason,
    stream_chunk,
    usage_of,
)
from kiln.runtime.tokenizer import IncrementalDetokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def _as_prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _echo_text(model: ServedModel, given: str | list[int], token_ids: list[int], generates: bool) -> str:
    """The prompt as ``echo`` returns it: the text as sent, or the token ids decoded with their special tokens (as
    vLLM echoes them: a BOS the client sent is part of the prompt). Ids that end inside a character leave it to the
    completion when one ``generates`` (its text starts with that character), so it is not written twice."""
    if isinstance(given, str):
        return given
    if model.tokenizer is None:
        return ""
    text = model.tokenizer.decode(token_ids, skip_special_tokens=False)
    if not generates:
        return text
    # what a completion of no tokens reads: the text of the prompt's unfinished last character (U+FFFD), else ""
    unfinished = IncrementalDetokenizer(model.tokenizer, token_ids, [], skip_special_tokens=False).take_delta(True)
    return text.removesuffix(unfinished)


def _echo_offsets(model: ServedModel, given: str | list[int], token_ids: list[int],
                  add_special_tokens: bool) -> list[int]:
    """Where each prompt token starts in the echoed prompt: in a text as sent, where the tokenizer found it (special
    tokens written in the text included); else in the ids' decoded text, special tokens kept as ``_echo_text``
    keeps them."""
    if isinstance(given, str) and model.tokenizer is not None:
        offsets = model.tokenizer.char_offsets(given, add_special_tokens)
        if len(offsets) == len(token_ids):
            return offsets
    return TextOffsets(model.tokenizer, [], skip_special_tokens=False).take(token_ids)


async def create_completion(model: ServedModel, req: CompletionRequest, metrics: ServerMetrics,
                            request: Request) -> object:
    """Handle POST /v1/completions."""
    request_id, created = response_id("cmpl-", request, req.request_id), int(time.time())  # first: its errors and
    # log lines carry a body's request_id too
    check_request(model, req)
    given = _as_prompt_list(req.prompt)
    model.admission.check_fits(len(given) * req.n, "prompt")  # before tokenizing a batch too large to run
    add_special_tokens = req.add_special_tokens is not False
    tokenized = await model.tokenize_many(given, "prompt", add_special_tokens,
                                          keep_last=model.kept_prompt_tokens(req.truncate_prompt_tokens))
    prompts = [prompt.ids for prompt in tokenized]
    given = [prompt.ids if prompt.cut else text  # a prompt cut short is echoed as the tokens kept
             for text, prompt in zip(given, tokenized, strict=True)]
    scoring = req.max_tokens == 0  # OpenAI's echo without generation: the prompt and its log probabilities alone
    if scoring and not req.echo:
        raise APIError(400, "max_tokens 0 generates nothing: with echo: true it returns the prompt alone (and its "
                            "log probabilities with logprobs), else ask for at least 1 token", param="max_tokens")
    limits = [model.max_tokens(len(ids), 1 if scoring else req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
                               "max_tokens") for ids in prompts]  # scoring runs the prefill, its one token dropped

    def counted(usage: Usage) -> Usage:
        """The usage the client sees: a scored prompt's dropped token is no completion token."""
        return usage_of(prompts, []) if scoring else usage

    echo_logprobs = req.logprobs if req.echo else None
    prompt_logprobs = max((k for k in (computed_prompt_logprobs(req), echo_logprobs) if k is not None), default=None)
    structured_output = await compiled_format(req)
    jobs = make_jobs(model, req, prompts, limits, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs,
                     structured_output=structured_output)
    model.check(jobs[::req.n], "prompt")  # one job per prompt: a prompt's n choices differ only in their seed
    chunk = functools.partial(stream_chunk, request_id, "text_completion", created, model.name,
                              with_usage=includes_usage(req))
    names = TokenText(model.tokenizer, req.return_tokens_as_token_ids)
    echoes = [_echo_text(model, p, ids, not scoring) if req.echo else "" for p, ids in zip(given, prompts, strict=True)]
    offsets = [TextOffsets(model.tokenizer, prompts[i // req.n], start=len(echoes[i // req.n]),
                           skip_special_tokens=req.skip_special_tokens)
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
                                    _echo_offsets(model, given[index // req.n], ids, add_special_tokens))
        more = completion_logprobs(names, entries, offsets[index].take([entry.token_id for entry in entries]))
        return piece.extend(more)

    def render(index: int, delta: StreamDelta) -> list[dict]:
        echo = ""
        if req.echo and index not in echoed:
            echoed.add(index)
            echo = echoes[index // req.n]
        text, entries = ("", None) if scoring else (delta.text, delta.logprobs)
        if not (echo or text or delta.finished or entries or delta.token_ids and not scoring):  # a chunk a step
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
                    TokenText(model.tokenizer), top_k(prompt_entries, req.prompt_logprobs))))
        return CompletionResponse(id=request_id, created=created, model=model.name, choices=choices,
                                  usage=counted(usage))

    return await respond(model, req, jobs, prompts, metrics, request, build=build,
                         stream=StreamEvents(render, lambda usage: chunk([], counted(usage)), generates=not scoring),
                         format_param=format_field(req) if structured_output is not None else None)

