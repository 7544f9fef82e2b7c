"""/v1/responses: OpenAI's Responses API over the chat path. The input items become chat messages (function calls
and their outputs too), the request runs as a chat completion (``chat.prepare_chat``), and its one choice comes
back as output items: a message with the text, then a ``function_call`` item per call (the calls first where the
text is that of a forced call a stop ended after them, as generated). Streamed, as OpenAI's typed events
(``response.created`` ... ``response.completed``). Nothing is stored between requests."""

from __future__ import annotations

import itertools
import re
import time
import uuid

from pydantic import ValidationError
from starlette.requests import Request

from kiln.runtime.outputs import RequestOutput, StreamDelta
from kiln.runtime.server.chat import ChatTools, StreamedText, prepare_chat
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.generation import ServedModel, value_or_default
from kiln.runtime.server.jobs import log_ignored_fields
from kiln.runtime.server.logprobs import TokenText, chat_logprobs
from kiln.runtime.server.metrics import ServerMetrics
from kiln.runtime.server.protocol import ChatCompletionRequest, SamplingExtensions, Usage, shared_ignored_fields
from kiln.runtime.server.reasoning import ReasoningSplitter
from kiln.runtime.server.request_id import response_id
from kiln.runtime.server.responding import StreamEvents, respond
from kiln.runtime.server.responses_protocol import (
    AllowedToolsChoice,
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kiln.runtime.server.tool_calls import ToolCall

LOGPROBS = "message.output_text.logprobs"  # the ``include`` entry that asks for the output's log probabilities
ENCRYPTED_REASONING = "reasoning.encrypted_content"  # the ``include`` entry taken and ignored: nothing is encrypted


def _messages(req: ResponsesRequest) -> list[dict]:
    """The chat messages of the instructions and the input items: consecutive function calls join the assistant
    message before them (one message with its calls, as chat templates take them), a reasoning item's text is the
    next assistant message's ``reasoning_content`` (an assistant message of its own when another role's message or
    a call's output comes first: a response cut off while it thought; left out at the end of the input), and a
    call's output comes after its call."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    called: set[str] = set()  # the calls passed back so far
    thought = ""  # a reasoning item's, for the assistant message after it

    def assistant(message: dict) -> dict:
        nonlocal thought
        message, thought = ({**message, "reasoning_content": thought} if thought else message), ""
        return message

    def thought_alone() -> None:
        if thought:
            messages.append(assistant({"role": "assistant", "content": ""}))

    for index, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            thought += item.text
        elif isinstance(item, MessageItem):
            if item.role != "assistant":
                thought_alone()
            message = {"role": item.role, "content": item.text}
            messages.append(assistant(message) if item.role == "assistant" else message)
        elif isinstance(item, FunctionCallItem):
            called.add(item.call_id)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and not thought:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:  # as OpenAI refuses it
                raise APIError(400, f"No tool call found for function call output with call_id {item.call_id}: "
                                    "pass the function_call item back before its output", param=f"input[{index}]")
            thought_alone()
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages  # a thought at the very end is left out: an assistant turn there would precede the answer's


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that answers ``req``."""
    fields: dict = {"model": req.model, "messages": _messages(req), "max_completion_tokens": req.max_output_tokens,
                    "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
                    "parallel_tool_calls": False if req.max_tool_calls == 1 else req.parallel_tool_calls,
                    # checked as chat checks it (only with stream: true); its one option changes nothing
                    "stream_options": req.stream_options and req.stream_options.model_dump(exclude_none=True),
                    "chat_template_kwargs": req.chat_template_kwargs,  # chat.template_variables adds the effort
                    "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None}
    fields.update(req.model_dump(mode="json", by_alias=True, include=set(SamplingExtensions.model_fields),
                                 exclude_unset=True))  # as a client sends them: token ids as keys, vLLM's names
    if LOGPROBS in (req.include or []):
        fields.update(logprobs=True, top_logprobs=req.top_logprobs)
    if req.tools:
        fields["tools"] = [{"type": "function", "function": tool.function()}
                           for tool in req.tools]
    if isinstance(req.tool_choice, AllowedToolsChoice):
        fields["tool_choice"] = {"type": "allowed_tools", "allowed_tools": {"mode": req.tool_choice.mode, "tools": [
            {"type": "function", "function": {"name": tool.name}} for tool in req.tool_choice.tools]}}
    elif req.tool_choice is not None:
        fields["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else {
            "type": "function", "function": {"name": req.tool_choice.name}}
    text_format = req.text.format if req.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.name or "response", "description": text_format.description,
            "schema": text_format.json_schema, "strict": text_format.strict}}
    try:
        return ChatCompletionRequest.model_validate({key: value for key, value in fields.items() if value is not None})
    except ValidationError as exc:  # what the request's own model let through and a chat request refuses
        error = exc.errors()[0]
        raise APIError(400, f"the input cannot be answered as a chat: {'.'.join(map(str, error['loc']))}: "
                            f"{error['msg']}", param="input") from None


def _ignored_fields(req: ResponsesRequest) -> list[str]:
    """The request's fields that change nothing, as the ignored-fields header names them (``store`` only when true:
    nothing is stored either way; of ``reasoning``, what is not its effort, which the template reads), and the keys
    of input items this server does not know, once each whichever items carry them (``input[].status``,
    ``input[].content[].cache_control``)."""
    names = shared_ignored_fields(req, req.store, req.stream_options)
    if isinstance(req.input, list):
        names.update(f"input[].{key}" for item in req.input for key in item.unknown_keys)
    names.update(f"tools[].{key}" for tool in req.tools or [] for key in ("allowed_callers", "output_schema")
                 if getattr(tool, key, None) is not None)
    if req.text is not None and req.text.verbosity is not None:
        names.add("text.verbosity")
    if req.truncation == "auto":  # nothing to truncate in a prompt that fits; one that does not is a 400
        names.add("truncation")
    if req.top_logprobs and LOGPROBS not in (req.include or []):  # as vLLM: alternatives only with the logprobs
        names.add("top_logprobs")
    if req.reasoning is not None:
        names.update(f"reasoning.{name}" for name in req.reasoning.model_fields_set - {"effort"})
    if ENCRYPTED_REASONING in (req.include or []):
        names.add(f"include.{ENCRYPTED_REASONING}")
    return sorted(names)


def _tool_choice(req: ResponsesRequest) -> str | dict:
    """The tool choice as the response echoes it (OpenAI's default: auto)."""
    if req.tool_choice is None:
        return "auto"
    return req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _call_item(call: ToolCall, status: str | None = None, arguments: str | None = None) -> OutputFunctionCall:
    """A function_call item: ``incomplete`` when the token limit cut the call off, else ``completed`` (or
    ``status``)."""
    return OutputFunctionCall(id=f"fc_{call.id}", call_id=call.id, name=call.name,
                              status=status or ("incomplete" if call.cut_off else "completed"),
                              arguments=call.arguments if arguments is None else arguments)


def _reasoning_item(item_id: str, text: str, status: str) -> OutputReasoning:
    return OutputReasoning(id=item_id, content=[ReasoningText(text=text)] if text else [], status=status)


def _logprobs(names: TokenText, entries: list) -> list[dict]:
    """An output text's ``logprobs``: each token's, with its alternatives, as the chat path reports them."""
    return chat_logprobs(names, entries).model_dump()["content"]


def _event_logprobs(entries: list[dict]) -> list[dict]:
    """``_logprobs`` as the text events carry them (``response.output_text.delta`` and ``.done``): each token's and
    its alternatives' ``token`` and ``logprob``, without the ``bytes`` of the output text part's."""
    return [{"token": entry["token"], "logprob": entry["logprob"],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]} for top in entry["top_logprobs"]]}
            for entry in entries]


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class _ResponseBuilder:
    """One request's response object: the request's settings echoed beside its status, output items and usage."""

    def __init__(self, req: ResponsesRequest, model: ServedModel, response_id: str) -> None:
        self.req, self.model_name, self.tokenizer = req, model.name, model.tokenizer
        self.id, self.created = response_id, int(time.time())
        # echoed as the request ran, as OpenAI's responses do
        self.temperature = value_or_default(req, "temperature", model.sampling_defaults, 1.0)
        self.top_p = value_or_default(req, "top_p", model.sampling_defaults, 1.0)

    def __call__(self, status: str, output: list, usage: Usage | None = None, reasoning: str = "",
                 error: ResponseError | None = None) -> ResponseObject:
        """The response object; with ``usage`` (once the answer is whole) its reasoning tokens those of the thought's
        text ``reasoning``, tokenized again; ``error`` says why a failed one failed."""
        req = self.req
        text_format = req.text.format if req.text is not None else None
        return ResponseObject(
            id=self.id, created_at=self.created, completed_at=int(time.time()) if usage is not None else None,
            status=status, error=error, incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete" else None, model=self.model_name, output=output, instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
            tools=[tool.model_dump(exclude_none=True) for tool in req.tools or []], tool_choice=_tool_choice(req),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            text={"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                  else {"type": "text"}, **({"verbosity": req.text.verbosity} if req.text and req.text.verbosity
                                            else {})},
            metadata=req.metadata or {}, truncation=req.truncation or "disabled",
            reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning else None,
            max_tool_calls=req.max_tool_calls, top_logprobs=req.top_logprobs, user=req.user,
            service_tier=req.service_tier, safety_identifier=req.safety_identifier,
            prompt_cache_key=req.prompt_cache_key,
            usage=ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                total_tokens=usage.total_tokens,
                                input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
                                output_tokens_details=OutputTokensDetails(reasoning_tokens=self._tokens(reasoning)))
            if usage is not None else None)

    def _tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text and self.tokenizer else 0


class _StreamedResponse:
    """The typed events of one streamed answer, numbered in order: the response created, its message item opened
    with its first text (or at the end, empty, when there are no calls either), each call's item whole at the end,
    then the response completed (or incomplete) with its usage."""

    def __init__(self, tools: ChatTools, splitter: ReasoningSplitter | None, response: _ResponseBuilder,
                 message_id: str, names: TokenText) -> None:
        self.streamed = StreamedText(tools, splitter)
        self.response, self.message_id, self.names = response, message_id, names
        self.sequence = itertools.count()
        self.text, self.opened, self.status = "", False, "completed"
        self.message_index = 0  # the message item's place in the output: after a reasoning item, if any
        self.reasoning_id, self.reasoning, self.thinking = _item_id("rs"), "", False
        self.logprobs: list[dict] = []  # the text's, each delta's sent with the next text delta
        self.held_logprobs: list[dict] = []  # of text the splitter holds: a thought's, or the answer's start
        self.unsent = 0
        self.output: list[dict] = []  # the finished items

    def event(self, kind: str, **fields: object) -> dict:
        return {"type": kind, "sequence_number": next(self.sequence), **fields}

    def prelude(self) -> list[dict]:
        started = self.response("in_progress", []).model_dump(mode="json")
        return [self.event("response.created", response=started), self.event("response.in_progress", response=started)]

    def render(self, index: int, delta: StreamDelta) -> list[dict]:
        before = self._reading()
        reasoning, content, calls = self.streamed.advance(delta)
        self._keep_logprobs(before, _logprobs(self.names, delta.logprobs) if delta.logprobs else [], content)
        if delta.finished:
            self.status = _status(delta.finish_reason)
        events = self._think(reasoning, delta.finished)
        first = calls if delta.finished and not self.opened and self.streamed.tools.grammar_writes_calls else []
        events += self._add_calls(first)
        self.message_index = len(self.output) if first else self.message_index
        events += self._open() if content or (delta.finished and not calls and not self.reasoning) else []
        if content:
            self.text += content
            events.append(self._text_delta(content))
        if delta.finished:
            if calls:  # the calls' tokens wrote none of the text
                del self.logprobs[self.unsent:]
            elif self.opened and self.unsent < len(self.logprobs):  # tokens that added no text (EOS, a stop string's)
                events.append(self._text_delta(""))
            events += self._close() + self._add_calls(calls[len(first):])
        return events

    def _text_delta(self, text: str) -> dict:
        """An ``output_text.delta`` event: ``text`` and the log probabilities not sent yet."""
        event = self.event("response.output_text.delta", item_id=self.message_id, output_index=self.message_index,
                           content_index=0, delta=text, logprobs=_event_logprobs(self.logprobs[self.unsent:]))
        self.unsent = len(self.logprobs)
        return event

    def _reading(self) -> str:
        """Where the reasoning splitter stands (``ReasoningSplitter.mode``); "answer" without one."""
        return self.streamed.splitter.mode if self.streamed.splitter is not None else "answer"

    def _keep_logprobs(self, before: str, entries: list[dict], content: str) -> None:
        """Keep the text's token logprobs, not the thought's (as vLLM's stream): those of text held while it may
        yet open or be a thought wait until the splitter knows."""
        after = self._reading()
        if after in ("undecided", "opening"):  # held: the start of a thought, or of the answer
            self.held_logprobs += entries
            return
        if after == "answer" and before == "undecided":  # what was held was the answer's start
            self.logprobs += self.held_logprobs + entries
        elif after == "answer" and (before == "answer" or content):
            self.logprobs += entries
        self.held_logprobs = []  # a thought's

    def _think(self, reasoning: str, finished: bool) -> list[dict]:
        """The reasoning item's events: opened with its first text, each text delta, and done once the thought is
        over (or the completion ended in it)."""
        events = []
        if reasoning and not self.thinking:
            self.thinking = True
            events.append(self.event("response.output_item.added", output_index=0,
                                     item=_reasoning_item(self.reasoning_id, "", "in_progress").model_dump()))
        if reasoning:
            self.reasoning += reasoning
            events.append(self.event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=0,
                                     content_index=0, delta=reasoning))
        splitter = self.streamed.splitter
        if self.thinking and (finished or splitter.thought_over):
            self.thinking = False
            item = _reasoning_item(self.reasoning_id, self.reasoning, "completed" if splitter.thought_over
                                   else self.status).model_dump()
            events += [self.event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=0,
                                  content_index=0, text=self.reasoning),
                       self.event("response.output_item.done", output_index=0, item=item)]
            self.output.append(item)
            self.message_index = 1
        return events

    def error(self, failed: APIError) -> list[dict]:
        """A failure mid-stream: an ``error`` event naming the field at fault, then the response failed (OpenAI's
        last event of a response that cannot finish), with the items finished so far."""
        reason = ResponseError(code="server_error" if failed.status_code >= 500 else "invalid_prompt",
                               message=failed.message)
        response = self.response("failed", self.output, error=reason).model_dump(mode="json")
        return [self.event("error", code=failed.code, message=failed.message, param=failed.param),
                self.event("response.failed", response=response)]

    def final(self, usage: Usage) -> dict:
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        response = self.response(self.status, self.output, usage, self.reasoning)
        return self.event(kind, response=response.model_dump(mode="json"))

    def _message(self, status: str) -> dict:
        parts = [OutputText(text=self.text, logprobs=self.logprobs)] if self.opened else []
        return OutputMessage(id=self.message_id, status=status, content=parts).model_dump()

    def _open(self) -> list[dict]:
        if self.opened:
            return []
        events = [self.event("response.output_item.added", output_index=self.message_index,
                             item=self._message("in_progress"))]
        self.opened = True
        return [*events, self.event("response.content_part.added", item_id=self.message_id,
                                    output_index=self.message_index, content_index=0,
                                    part=OutputText(text="").model_dump())]

    def _close(self) -> list[dict]:
        events = []
        if self.opened:
            part = dict(item_id=self.message_id, output_index=self.message_index, content_index=0)
            message = self._message(self.status)
            events += [self.event("response.output_text.done", **part, text=self.text,
                                  logprobs=_event_logprobs(self.logprobs)),
                       self.event("response.content_part.done", **part, part=message["content"][0]),
                       self.event("response.output_item.done", output_index=self.message_index, item=message)]
            self.output.append(message)
        return events

    def _add_calls(self, calls: list[ToolCall]) -> list[dict]:
        events = []
        for call in calls:
            index, item_id, done = len(self.output), f"fc_{call.id}", _call_item(call).model_dump()
            events += [self.event("response.output_item.added", output_index=index,
                                  item=_call_item(call, "in_progress", "").model_dump()),
                       self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                  delta=call.arguments),
                       self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                  name=call.name, arguments=call.arguments),
                       self.event("response.output_item.done", output_index=index, item=done)]
            self.output.append(done)
        return events


async def create_response(model: ServedModel, req: ResponsesRequest, metrics: ServerMetrics,
                          request: Request) -> object:
    """Handle POST /v1/responses."""
    resp_id = response_id("resp_", request, req.request_id)  # first: its errors and log lines carry a body's id too
    chat = chat_request(req)
    try:
        plan = await prepare_chat(model, chat, req.max_tool_calls)
    except APIError as exc:
        raise _in_responses_terms(exc) from None
    ignored = _ignored_fields(req)
    log_ignored_fields(model, ignored)
    response = _ResponseBuilder(req, model, resp_id)
    message_id = _item_id("msg")

    def build(outputs: list[RequestOutput], usage: Usage) -> ResponseObject:
        [out] = outputs
        reasoning, answer, thought_over = plan.split(out.text)
        content, calls = plan.tools.parse(answer, stopped=out.finish_reason != "length")
        status = _status(out.finish_reason)
        logprobs = _logprobs(plan.names, out.logprobs) if out.logprobs is not None else []
        thought = [_reasoning_item(_item_id("rs"), reasoning, "completed" if thought_over else status)
                   ] if reasoning else []
        message = [OutputMessage(id=message_id, status=status,
                                 content=[OutputText(text=content or "", logprobs=logprobs)])]
        shown = message if content or not (calls or reasoning) else []
        made = [_call_item(call) for call in calls]
        items = [*made, *shown] if plan.tools.grammar_writes_calls else [*shown, *made]
        return response(status, [*thought, *items], usage, reasoning or "")

    stream = _StreamedResponse(plan.tools, plan.splitter(), response, message_id, plan.names)
    events = StreamEvents(stream.render, stream.final, stream.prelude(), with_usage=True, error=stream.error,
                          done=b"")  # the last event carries the usage; no [DONE], as OpenAI's streams end
    return await respond(model, chat, plan.jobs, [plan.prompt], metrics, request, build=build, stream=events,
                         ignored=[*ignored, *(_CHAT_NAMES.get(n, n) for n in plan.unused)],
                         format_param=plan.format_param and _CHAT_NAMES.get(plan.format_param, plan.format_param))


# the chat request's fields that answer the Responses request's, as its errors name them
_CHAT_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort"}


# the chat request's paths into its tools and tool choice -> the Responses API's (its tools are flat)
_CHAT_PATHS = ((re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
               (re.compile(r"\btool_choice\.allowed_tools\b"), "tool_choice"))


def _in_responses_terms(error: APIError) -> APIError:
    """A 400 of the chat path as the Responses request's fields name it."""
    def rename(text: str) -> str:
        for path, responses_path in _CHAT_PATHS:
            text = path.sub(responses_path, text)
        return re.sub(r"\b(" + "|".join(_CHAT_NAMES) + r")\b", lambda found: _CHAT_NAMES[found.group(1)], text)

    return APIError(error.status_code, rename(error.message), param=error.param and rename(error.param),
                    code=error.code, headers=error.headers)
