"""/v1/chat/completions: messages through the model's chat template (with its tools), the completion back as a
message, or as tool calls parsed in the format the template teaches (``tool_calls.py``)."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from kiln.runtime.chat_template import (
    ChatTemplateError,
    ReservedVariableError,
    UncontinuableMessageError,
    message_text,
    template_message,
)
from kiln.runtime.outputs import RequestOutput, StreamDelta
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.generation import Job, ServedModel
from kiln.runtime.server.jobs import (
    check_request,
    compiled_format,
    computed_prompt_logprobs,
    format_field,
    make_jobs,
)
from kiln.runtime.server.logprobs import TokenText, chat_logprobs, vllm_prompt_logprobs
from kiln.runtime.server.metrics import ServerMetrics
from kiln.runtime.server.protocol import (
    AllowedToolChoice,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    FunctionCall,
    NamedToolChoice,
    TokenizeRequest,
    Tool,
    ToolCallOut,
    Usage,
)
from kiln.runtime.server.reasoning import ReasoningSplitter, split_reasoning, thinking_at_start
from kiln.runtime.server.request_id import response_id
from kiln.runtime.server.responding import StreamEvents, includes_usage, respond, stop_reason, stream_chunk
from kiln.runtime.server.tool_calls import ToolCall, ToolCallFormat
from kiln.runtime.structured_output import (
    FormatTooLargeError,
    StructuredOutput,
    StructuredOutputError,
    json_format_rule,
)
from kiln.runtime.tokenizer import Tokenizer

# tools' parameters (their JSON, keys sorted) that compiled, the least recently sent first
_COMPILED_PARAMETERS: dict[str, None] = {}
_MAX_COMPILED_PARAMETERS = 1024
_GRAMMAR_PLACE = re.compile(r"\bat \d+\(\d+\): ")  # where llguidance's error is in a grammar: "at 3(7): "
# a conversation this long renders within a millisecond or two (a few microseconds a message): on the event loop
RENDER_THREAD_MESSAGES = 256


def template_variables(req: ChatCompletionRequest) -> dict[str, Any]:
    """The further chat template variables of a request, as vLLM passes them: its ``documents`` and
    ``reasoning_effort`` (an effort of "none" also as ``enable_thinking`` false, Qwen3's switch), under what its
    ``chat_template_kwargs`` set."""
    fields = {"documents": req.documents, "reasoning_effort": req.reasoning_effort}
    variables = {name: value for name, value in fields.items() if value is not None}
    if req.reasoning_effort == "none":
        variables["enable_thinking"] = False
    return {**variables, **(req.chat_template_kwargs or {})}


def unread_template_fields(model: ServedModel, req: ChatCompletionRequest | TokenizeRequest) -> list[str]:
    """The request's template variables that the chat template that rendered it (``tool_use`` for one with tools,
    where the model has it) never reads, by the names the request gives them: a ``chat_template_kwargs`` key,
    ``documents``, ``reasoning_effort`` (read as itself, or as ``enable_thinking`` when it is "none"; /tokenize takes
    only the first)."""
    given = {f"chat_template_kwargs.{name}": {name} for name in req.chat_template_kwargs or {}}
    if getattr(req, "documents", None) is not None:
        given["documents"] = {"documents"}
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:  # only "none" reaches the template as enable_thinking too
        given["reasoning_effort"] = {"reasoning_effort", *(("enable_thinking",) if effort == "none" else ())}
    reads = model.chat_template.for_tools(req.tools).reads  # the tools as render_chat got them
    return [name for name, variables in given.items() if not variables & reads]


def render_chat(model: ServedModel, messages: list[ChatMessage], tools: list[dict] | None,
                add_generation_prompt: bool = True, variables: dict[str, Any] | None = None,
                continue_final_message: bool = False) -> str:
    """The prompt text of ``messages`` (and ``tools``, and the request's further template variables as
    ``variables``: ``template_variables``, or /tokenize's ``chat_template_kwargs``) through the model's chat template
    (its ``tool_use`` one with tools, where it has one, as transformers and vLLM pick it; it writes BOS itself, as in
    transformers, so the text is tokenized without special tokens); with
    ``continue_final_message``, cut right after the final message's content, which the completion continues. A 400
    for tool results that answer no call right before them (``check_tool_results``), and for a history with tool
    calls that the template would leave out of the prompt."""
    if model.chat_template is None:
        raise APIError(400, model.chat_template_problem or f"model '{model.name}' has no chat template (neither "
                       f"chat_template.jinja nor tokenizer_config.json has one, and kiln serve got no "
                       f"--chat-template): use /v1/completions", param="messages")
    check_tool_results(messages)
    rendered = [template_message(m.model_dump(exclude_none=True)) for m in messages]
    try:
        text, dropped = model.chat_template.render_with_calls(rendered, add_generation_prompt, tools, variables,
                                                              continue_final_message)
    except ReservedVariableError as exc:
        raise APIError(400, str(exc), param="chat_template_kwargs") from None
    except UncontinuableMessageError as exc:
        raise APIError(400, str(exc), param="continue_final_message") from None
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None
    if dropped is not None:
        raise APIError(400, f"the chat template of model '{model.name}' does not render tool calls, so those of "
                            f"messages[{dropped}] would be left out of the prompt: send the history without them, "
                            f"or serve the model with a --chat-template that renders them",
                       param=f"messages[{dropped}].tool_calls")
    return text


def check_tool_results(messages: list[ChatMessage]) -> None:
    """OpenAI's rule for tool results: a 'tool' message follows an assistant message with ``tool_calls`` (right
    after it, or after other tool messages) and answers one of its calls; a 400 naming the first that does not.
    Calls left without a result are taken, as vLLM takes them."""
    calls: set[str] | None = None  # the ids a tool message here may answer (None: it may not be here)
    for index, message in enumerate(messages):
        if message.role == "assistant" and message.tool_calls:
            calls = {call.id for call in message.tool_calls}
        elif message.role != "tool":
            calls = None
        elif calls is None:
            raise APIError(400, f"messages[{index}]: a message with role 'tool' must answer a preceding assistant "
                                f"message with tool_calls (right after it, or after its other tool messages): pass "
                                f"that assistant message back before it", param=f"messages[{index}]")
        elif message.tool_call_id not in calls:
            raise APIError(400, f"No tool call found for tool message with tool_call_id {message.tool_call_id!r}: "
                                f"the assistant message before it called {', '.join(map(repr, sorted(calls)))}",
                           param=f"messages[{index}].tool_call_id")


async def render_chat_off_loop(model: ServedModel, messages: list[ChatMessage], tools: list[dict] | None,
                               add_generation_prompt: bool = True, variables: dict[str, Any] | None = None,
                               continue_final_message: bool = False) -> str:
    """``render_chat``, on a worker thread for more than RENDER_THREAD_MESSAGES messages: the template runs as
    Python code, which gives the GIL up every switch interval, so the event loop serves other requests meanwhile (99,000
    short messages had held every stream and /health for over half a second)."""
    render = functools.partial(render_chat, model, messages, tools, add_generation_prompt, variables,
                               continue_final_message)
    return await asyncio.to_thread(render) if len(messages) > RENDER_THREAD_MESSAGES else render()


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """A request's ``tools`` as the chat template takes them (OpenAI tool objects): an empty list too, as
    transformers passes it (Llama 3.1's template writes its tool preamble for ``[]``)."""
    if tools is None:
        return None
    return [{"type": "function", "function": tool.function.model_dump(exclude_none=True)} for tool in tools]


def require_tool_format(model: ServedModel) -> ToolCallFormat:
    """The format the model calls tools in (the one its template for tools teaches): a 400 when that template does
    not render tools."""
    if model.tool_call_format is None:
        raise APIError(400, f"the chat template of model '{model.name}' does not render tools, so the model cannot "
                            f"call them: send no tools (or, to chat, tool_choice 'none')", param="tools")
    return model.tool_call_format


class ChatTools:
    """What a request's ``tools`` and ``tool_choice`` ask of this model: the tools its template renders, the format
    it calls them in, which of them may be called (``allowed_tools``: a subset), whether (and which) a call is
    forced, and how many calls it keeps (``max_calls``: the Responses API's ``max_tool_calls``)."""

    def __init__(self, model: ServedModel, req: ChatCompletionRequest, max_calls: int | None = None) -> None:
        self.rendered = template_tools(req.tools)
        self.functions = [tool["function"] for tool in self.rendered or []]
        self.callable = self.functions  # the tools a call may name
        choice = self.choice = req.tool_choice or ("auto" if self.functions else "none")
        self.format: ToolCallFormat | None = None
        self.forced: list[dict] = []
        self.calls_or_answer = False  # auto beside a JSON response_format: its grammar holds the output (see below)
        self.named = False  # tool_choice names the function to call
        if choice == "none" or not self.functions:
            if not isinstance(choice, str) or choice == "required":
                raise APIError(400, f"tool_choice {_choice_name(choice)} needs tools", param="tool_choice")
            return
        self.format = require_tool_format(model)
        if isinstance(choice, AllowedToolChoice):
            self.callable = self._allowed(choice.allowed_tools.tools)
            self.forced = self.callable if choice.allowed_tools.mode == "required" else []
        elif choice == "required":
            self.forced = self.functions
        elif not isinstance(choice, str):
            self.named = True
            self.forced = [f for f in self.functions if f["name"] == choice.function.name]
            if not self.forced:
                raise APIError(400, f"tool_choice names '{choice.function.name}', which is not among the tools",
                               param="tool_choice")
        self.parallel = req.parallel_tool_calls is not False and not self.named  # a named choice: one call
        self.max_calls = max_calls if self.parallel else 1

    def keeps_special_tokens(self, tokenizer: Tokenizer) -> bool:
        """Whether the completion's text keeps its special tokens (``skip_special_tokens`` off, as vLLM's mistral
        parser turns it off) so that calls may be read where the format's prefix, a special token, marks them."""
        return self.format is not None and self.format.prefix_kept and tokenizer.is_special(self.format.prefix)

    @property
    def names(self) -> set[str]:
        """The names a call may have: a call of another tool stays text."""
        return {f["name"] for f in self.callable}

    def _allowed(self, listed: list[NamedToolChoice]) -> list[dict]:
        """The tools ``allowed_tools`` lists, in the request's order; a 400 for a name that is not among them."""
        known = {f["name"] for f in self.functions}
        for index, tool in enumerate(listed):
            if tool.function.name not in known:
                raise APIError(400, f"tool_choice allows '{tool.function.name}', which is not among the tools",
                               param=f"tool_choice.allowed_tools.tools[{index}]")
        allowed = {tool.function.name for tool in listed}
        return [f for f in self.functions if f["name"] in allowed]

    def check_parameters(self, indexes: list[int]) -> None:
        """Compile the parameters of the tools at ``indexes``: a 400 naming the first whose parameters do not compile
        (no call could be held to them)."""
        for index in indexes:
            try:
                _ = StructuredOutput(json=self.functions[index].get("parameters", {})).llguidance_grammar
            except StructuredOutputError as exc:
                raise self._refused(index, exc) from None

    def structured_output(self) -> StructuredOutput | None:
        """The grammar of a forced call (None when the model may answer in text)."""
        return self._grammar(self.forced) if self.forced else None

    def answer_or_calls(self, answer: StructuredOutput) -> StructuredOutput:
        """The grammar of ``tool_choice`` auto beside a JSON ``answer`` format (``response_format``, which an agent
        sends on every turn): calls of the tools, as ``required`` forces them, or an answer in that format."""
        self.calls_or_answer = True
        return self._grammar(self.callable, json_format_rule(answer))

    def _grammar(self, functions: list[dict], answer: str | None = None) -> StructuredOutput:
        """The grammar of calls of ``functions`` (or ``answer``, a Lark rule), compiled; a 400 where it cannot be,
        naming the tool whose call alone cannot be held (in words about its schema, not the grammar's)."""
        with_answer = " beside response_format" if answer else ""
        try:
            return self._compiled(functions, answer)
        except FormatTooLargeError as exc:  # no tool is to blame, and compiling each alone would take seconds
            raise APIError(400, f"tool_choice {_choice_name(self.choice)}{with_answer}: the calls of {len(functions)} "
                                f"tools are too large a grammar ({_first_line(exc)}): send fewer tools, or name "
                                f"those that may be called in allowed_tools", param="tools") from None
        except StructuredOutputError as exc:
            for function in functions:
                try:
                    self._compiled([function])
                except StructuredOutputError as alone:
                    raise self._refused(self.functions.index(function), alone) from None
            raise APIError(400, f"tool_choice {_choice_name(self.choice)}{with_answer} cannot hold the calls to the "
                                f"tools' parameters together: {_first_line(exc)}", param="tools") from None

    def _compiled(self, functions: list[dict], answer: str | None = None) -> StructuredOutput:
        """The grammar of calls of ``functions`` (or ``answer``), compiled; StructuredOutputError where it is not."""
        calls = StructuredOutput(grammar=self.format.grammar(functions, self.parallel, answer))
        _ = calls.llguidance_grammar
        return calls

    def _refused(self, index: int, exc: StructuredOutputError) -> APIError:
        """The 400 for the tool at ``index`` whose parameters its calls cannot follow."""
        return APIError(400, f"the parameters of tool '{self.functions[index]['name']}' are no schema its calls can "
                             f"follow: {_first_line(exc)}", param=f"tools[{index}].function.parameters")

    @property
    def grammar_writes_calls(self) -> bool:
        """Whether a grammar writes the calls (a forced call, or calls or the answer beside a JSON format): then text
        beside calls is that of a call a stop ended inside, written after them (``parse``)."""
        return bool(self.forced or self.calls_or_answer)

    def parse(self, text: str, stopped: bool = False) -> tuple[str | None, list[ToolCall]]:
        """The content and the calls in a finished completion (``stopped``: ended by a stop string, a
        ``stop_token_ids`` id or its grammar, not by the token limit): calls of the tools that may be called only,
        and only the first ``max_calls`` (one with ``parallel_tool_calls`` false). A forced call's completion (or
        calls that ``answer_or_calls``'s grammar wrote) has no content; a call the token limit cut off comes back
        with its arguments as far as they got, and the text of one a stop ended inside is the content, as that of a
        call that does not parse."""
        if self.format is None:
            return text, []
        names = self.names
        content, calls = self.format.parse(text, names)
        if self.grammar_writes_calls:  # calls alone, or the answer instead
            if stopped:  # the grammar finished, or a stop ended it inside a call: that call stays text
                content = self.format.unfinished_call(text, names)
            else:  # a call it did not finish was cut off by the token limit
                cut = self.format.cut_off_call(text, names)
                calls, content = [*calls, cut] if cut else calls, None
            if self.forced or calls:
                return content or None, calls[:self.max_calls]
        return (content or None) if calls else text, calls[:self.max_calls]

    def finish_reason(self, calls: list[ToolCall], engine_reason: str, content: str | None) -> str:
        """OpenAI's finish reason for a choice of ``calls`` and ``content`` (``parse``'s): the engine's when there
        are no calls, the output was cut off (a call may be missing or incomplete: ``length``), or a stop ended it
        inside a call a grammar wrote (its text the content); ``stop`` for the call of a named ``tool_choice`` and
        ``tool_calls`` for calls the model chose or ``required`` made, as OpenAI and vLLM say."""
        if not calls or engine_reason != "stop" or (content and self.grammar_writes_calls):
            return engine_reason
        return "stop" if self.named else "tool_calls"


def _first_line(exc: StructuredOutputError) -> str:
    """An error's first line, without llguidance's place in a grammar the request never wrote (nor the grammar)."""
    return _GRAMMAR_PLACE.sub("", str(exc).splitlines()[0])


def _choice_name(choice: object) -> str:
    if isinstance(choice, AllowedToolChoice):
        return f"allowed_tools ({choice.allowed_tools.mode!r})"
    return repr(choice) if isinstance(choice, str) else f"naming '{choice.function.name}'"


def _call_parts(calls: list[ToolCall]) -> list[dict]:
    """Tool-call deltas of a stream, each call whole (as the openai client assembles them)."""
    return [{"index": i, "id": call.id, "type": "function", "function": {"name": call.name,
                                                                         "arguments": call.arguments}}
            for i, call in enumerate(calls)]


@dataclass
class ChatPlan:
    """A chat request made ready to run: its tools, its prompt's token ids and its jobs (one per choice), with a
    reasoning parser whether the completions start inside a thought (None without one), and the output-format fields
    a forced tool call set aside (named in the ignored-fields header)."""

    tools: ChatTools
    prompt: list[int]
    jobs: list[Job]
    names: TokenText
    thinking: bool | None = None
    # the request's fields its answer does not use: an output format a forced tool call set aside, and template
    # variables the chat template never reads (named in the Kiln-Ignored-Fields header)
    unused: list[str] = field(default_factory=list)
    format_param: str | None = None  # the field that set the output format (tool_choice for a forced call)

    def splitter(self) -> ReasoningSplitter | None:
        """A fresh reader of one choice's thinking and answer (None without a reasoning parser)."""
        return None if self.thinking is None else ReasoningSplitter(self.thinking)

    def split(self, text: str) -> tuple[str | None, str, bool]:
        """A whole completion's reasoning (None without one or without a parser), answer, and whether its thought
        ended (or it had none)."""
        return (None, text, True) if self.thinking is None else split_reasoning(text, self.thinking)


# the fields that ask for an output format (vLLM's guided_* are structured_outputs' older names)
FORMAT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar")


async def prepare_chat(model: ServedModel, req: ChatCompletionRequest, max_tool_calls: int | None = None) -> ChatPlan:
    """Check a chat request, render its messages and tools through the chat template and make its jobs (400s
    naming the field at fault); ``max_tool_calls``: how many of a choice's calls to keep (default: all)."""
    check_request(model, req)
    tools = ChatTools(model, req, max_tool_calls)
    await check_tool_parameters(tools)
    forced = await asyncio.to_thread(tools.structured_output) if tools.forced else None
    requested = await compiled_format(req)
    overridden = []  # the output format a forced call sets aside for this turn, as vLLM and OpenAI take it (an
    if forced is not None and requested is not None:  # agent sends its final answer's schema on every turn)
        overridden = [name for name in FORMAT_FIELDS if getattr(req, name) is not None]
        requested = None
    elif requested is not None and tools.format is not None and format_field(req) == "response_format":
        requested = await asyncio.to_thread(tools.answer_or_calls, requested)  # auto: a call, or the answer
    text = await render_chat_off_loop(model, req.messages, tools.rendered, req.add_generation_prompt,
                                      template_variables(req), req.continue_final_message)
    [tokenized] = await model.tokenize_many([text], "messages", add_special_tokens=False,  # the template writes BOS
                                            keep_last=model.kept_prompt_tokens(req.truncate_prompt_tokens))
    prompt = tokenized.ids
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    limit = model.max_tokens(len(prompt), req.max_completion_tokens or req.max_tokens, None, param)
    if req.top_logprobs is not None and not req.logprobs:  # 0 too, as vLLM and OpenAI refuse it
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.skip_special_tokens and tools.keeps_special_tokens(model.tokenizer):
        req = req.model_copy(update={"skip_special_tokens": False})
    jobs = make_jobs(model, req, [prompt], [limit], logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                     prompt_logprobs=computed_prompt_logprobs(req), structured_output=forced or requested,
                     max_tokens_param=param)
    model.check(jobs[::req.n], "messages")
    thinking = None
    if model.reasoning_parser:  # a grammar writes the answer from its first token: no thought the prompt opened
        thinking = (forced or requested) is None and thinking_at_start(
            await generation_prompt(model, req, tools, text), model.reasoning_parser)
    format_param = "tool_choice" if forced is not None else format_field(req) if requested is not None else None
    return ChatPlan(tools, prompt, jobs, TokenText(model.tokenizer, req.return_tokens_as_token_ids), thinking,
                    [*overridden, *unread_template_fields(model, req)], format_param)


async def check_tool_parameters(tools: ChatTools) -> None:
    """Every tool's parameters compiled, whatever ``tool_choice`` is (``ChatTools.check_parameters``), off the event
    loop; parameters that compiled before are not compiled again, and a request whose tools all did takes no worker
    thread (an agent sends the same tools on every turn)."""
    keys = [json.dumps(function.get("parameters", {}), sort_keys=True) for function in tools.functions]
    if new := [index for index, key in enumerate(keys) if key not in _COMPILED_PARAMETERS]:
        await asyncio.to_thread(tools.check_parameters, new)
    for key in keys:  # the most recently sent last (written on the event loop only: no lock)
        _COMPILED_PARAMETERS.pop(key, None)
        _COMPILED_PARAMETERS[key] = None
    while len(_COMPILED_PARAMETERS) > _MAX_COMPILED_PARAMETERS:
        del _COMPILED_PARAMETERS[next(iter(_COMPILED_PARAMETERS))]


async def generation_prompt(model: ServedModel, req: ChatCompletionRequest, tools: ChatTools, prompt_text: str
                            ) -> str:
    """What the template adds to the messages for the answer (``prompt_text`` less the messages rendered alone), or
    the final message that the answer continues."""
    if req.continue_final_message:
        return message_text(req.messages[-1].content)
    messages = await render_chat_off_loop(model, req.messages, tools.rendered, add_generation_prompt=False,
                                          variables=template_variables(req))
    return prompt_text[len(messages):] if prompt_text.startswith(messages) else prompt_text


class StreamedText:
    """One streamed choice's text split into reasoning (with a ``splitter``), content and tool calls: reasoning and
    content go out as they come, except what may be the start of a call, which is held back until the completion
    ends and then parsed."""

    def __init__(self, tools: ChatTools, splitter: ReasoningSplitter | None) -> None:
        self.tools = tools
        self.splitter = splitter
        self.text = ""  # the answer so far
        self.sent = 0  # characters of the answer that went out as content
        self.finish_reason: str | None = None  # OpenAI's, once the last delta came

    def advance(self, delta: StreamDelta) -> tuple[str, str, list[ToolCall]]:
        """The reasoning and the content this delta lets go out, and on the last delta the calls (and
        ``finish_reason``)."""
        reasoning, answer = self.splitter.feed(delta.text, delta.finished) if self.splitter else ("", delta.text)
        if delta.finished:
            self.finish_reason = delta.finish_reason
        if self.tools.format is None:
            return reasoning, answer, []
        self.text += answer
        calls: list[ToolCall] = []
        if delta.finished:
            content, calls = self.tools.parse(self.text, stopped=delta.finish_reason != "length")
            self.finish_reason = self.tools.finish_reason(calls, delta.finish_reason, content)
            content = (content or "")[self.sent:]
        else:
            safe = 0 if self.tools.forced else self.tools.format.content_before_calls(self.text)
            content = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent += len(content)
        return reasoning, content, calls

    @property
    def holding(self) -> bool:
        """Whether text is held back (what may start a call, or a tag)."""
        return len(self.text) > self.sent or bool(self.splitter and self.splitter.held)


async def create_chat_completion(model: ServedModel, req: ChatCompletionRequest, metrics: ServerMetrics,
                                 request: Request) -> object:
    """Handle POST /v1/chat/completions."""
    request_id, created = response_id("chatcmpl-", request, req.request_id), int(time.time())  # first: its errors
    # and log lines carry a body's request_id too
    plan = await prepare_chat(model, req)
    tools, jobs, names = plan.tools, plan.jobs, plan.names
    chunk = functools.partial(stream_chunk, request_id, "chat.completion.chunk", created, model.name,
                              with_usage=includes_usage(req))
    streamed = [StreamedText(tools, plan.splitter()) for _ in jobs]

    def opening(index: int) -> list[dict]:
        """A choice's role chunk, sent with its first delta's chunks, so that a client timing the first token from
        the first chunk reads when the tokens began (as vLLM sends it)."""
        return [chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}])]

    def render(index: int, delta: StreamDelta) -> list[dict]:
        message = {}
        reasoning, content, calls = streamed[index].advance(delta)
        reasoning = reasoning if req.include_reasoning else ""
        reason = streamed[index].finish_reason if delta.finished else None
        if calls:
            message["tool_calls"] = _call_parts(calls)
        if content:
            message = {"content": content, **message}
        if reasoning:
            message = {"reasoning": reasoning, "reasoning_content": reasoning, **message}
        if not message and delta.token_ids and not delta.text and not streamed[index].holding:
            message = {"content": ""}  # tokens that add no text yet: a chunk a step (none while text is held back,
            # as vLLM's tool parsers send none while they read a call)
        if not (message or delta.finished or delta.logprobs):
            return []
        logprobs = chat_logprobs(names, delta.logprobs).model_dump() if delta.logprobs else None
        if "tool_calls" in message:  # one call per chunk (as OpenAI and vLLM send them: LlamaIndex's accumulator
            # reads only a delta's first call), then the finish reason in a chunk of its own, as OpenAI sends it
            parts = message.pop("tool_calls")
            first = {**message, "tool_calls": parts[:1]}
            return [chunk([{"index": index, "delta": first, "logprobs": logprobs, "finish_reason": None}]),
                    *(chunk([{"index": index, "delta": {"tool_calls": [part]}, "logprobs": None,
                              "finish_reason": None}]) for part in parts[1:]),
                    chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason,
                            "stop_reason": stop_reason(delta)}])]
        return [chunk([{"index": index, "delta": message, "logprobs": logprobs, "finish_reason": reason,
                        "stop_reason": stop_reason(delta)}])]

    def choice(index: int, out: RequestOutput) -> ChatChoice:
        reasoning, answer, _ = plan.split(out.text)
        reasoning = reasoning if req.include_reasoning else None
        content, calls = tools.parse(answer, stopped=out.finish_reason != "length")
        tool_calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
        parsed = plan.thinking is not None  # a reasoning parser's answer is null when empty, as vLLM's parsers give it
        message = AssistantMessage(content=None if parsed and not content else content,
                                   tool_calls=tool_calls or None, reasoning=reasoning, reasoning_content=reasoning)
        reason = tools.finish_reason(calls, out.finish_reason, content)
        return ChatChoice(index=index, message=message, finish_reason=reason, stop_reason=out.stop_reason,
                          logprobs=chat_logprobs(names, out.logprobs) if out.logprobs is not None else None)

    def build(outputs: list[RequestOutput], usage: Usage) -> ChatCompletionResponse:
        prompt_entries = outputs[0].prompt_logprobs if req.prompt_logprobs is not None else None
        return ChatCompletionResponse(id=request_id, created=created, model=model.name, usage=usage,
                                      choices=[choice(i, out) for i, out in enumerate(outputs)],
                                      prompt_logprobs=prompt_entries and vllm_prompt_logprobs(
                                          TokenText(model.tokenizer), prompt_entries))

    return await respond(model, req, jobs, [plan.prompt], metrics, request, build=build,
                         ignored=[*req.ignored_fields(), *plan.unused], format_param=plan.format_param,
                         stream=StreamEvents(render, lambda usage: chunk([], usage), opening=opening))
