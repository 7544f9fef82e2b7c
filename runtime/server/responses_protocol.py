"""OpenAI's Responses API bodies (``POST /v1/responses``): the request, strict as the chat request is (a wrong type
or an unknown field is a 400 naming it), its input items (an unknown key on one or its parts ignored, as on a chat
message), and the response object with its output items."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from kiln.runtime.server.protocol import (
    ChatTemplateKwargs,
    FunctionDefinition,
    Int,
    Moderation,
    NoAnnotations,
    PromptCacheOptions,
    PromptCacheRetention,
    ReasoningEffort,
    SamplingExtensions,
    ServiceTier,
    StrictModel,
    Unsupported,
    Verbosity,
    neutral_only,
    tool_choice_of,
)


def _joined(content: str | list[TextPart]) -> str:
    """Content as one text: its parts joined by newlines (as the chat endpoint joins them)."""
    return content if isinstance(content, str) else "\n".join(part.value for part in content)


STATELESS = "this server keeps no responses or conversations: send the whole conversation as input"


class InputModel(StrictModel):
    """An input item or one of its parts: its known fields as strict as the request's, a key this server does not
    know ignored, as vLLM takes items (openai-python's types, which allow any; the Agents SDK and LiteLLM pass output
    items back with keys no server sent, ``provider_specific_fields``, and parts with ``cache_control``): kept aside
    (``model_extra``), never rendered, its name in ``unknown_keys`` for the request to name."""

    model_config = ConfigDict(extra="allow")

    @property
    def unknown_keys(self) -> list[str]:
        """The keys it was sent with that this server does not know."""
        return list(self.model_extra or ())


def _part_keys(field: str, parts: Any) -> list[str]:
    """The unknown keys of ``parts`` (a list of parts; a text has none) as ``FIELD[].KEY``, once each."""
    keys = (f"{field}[].{key}" for part in parts for key in part.unknown_keys) if isinstance(parts, list) else ()
    return list(dict.fromkeys(keys))


class TextPart(InputModel):
    """Text in a message item: ``input_text``, or an earlier answer's ``output_text`` (or ``refusal``) passed back."""

    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    annotations: NoAnnotations = None
    logprobs: Any = Field(None, exclude=True, description="An earlier answer's log probabilities: not rendered.")
    parsed: Any = Field(None, exclude=True, description="What the openai client's parse helpers parsed the text "
                                                       "into: not rendered.")

    @model_validator(mode="after")
    def _has_its_text(self) -> TextPart:
        """A part holds its text (``refusal`` for a refusal, ``text`` otherwise), as OpenAI requires it: a part
        without it would ask an empty question."""
        field = "refusal" if self.type == "refusal" else "text"
        if getattr(self, field) is None:
            raise ValueError(f"a {self.type} part needs its {field} (a string), as OpenAI requires")
        return self

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class MessageItem(InputModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    @property
    def unknown_keys(self) -> list[str]:
        """Its own unknown keys and its parts' (``content[].cache_control``)."""
        return [*super().unknown_keys, *_part_keys("content", self.content)]

    @property
    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(InputModel):
    """An earlier call of a function tool, passed back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    # what the openai client's output items carry besides (``item.model_dump()`` passed back): taken, not rendered
    namespace: None = None
    caller: dict[str, Any] | None = Field(None, exclude=True)
    async_: Literal[False] | None = Field(None, exclude=True, validation_alias=AliasChoices("async", "async_"))
    parsed_arguments: Any = Field(None, exclude=True)


class FunctionCallOutputItem(InputModel):
    """What a function call returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    @property
    def unknown_keys(self) -> list[str]:
        """Its own unknown keys and its parts' (``output[].KEY``)."""
        return [*super().unknown_keys, *_part_keys("output", self.output)]

    @property
    def text(self) -> str:
        return _joined(self.output)


class ReasoningTextPart(InputModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(InputModel):
    """An earlier answer's thought (a reasoning item of its output), passed back: its text (or its summary) reaches
    the template as the next assistant message's reasoning_content."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        """Its text, else its summary's (OpenAI's reasoning items carry a summary alone), as vLLM reads it."""
        if self.content:
            return "".join(part.text for part in self.content)
        return "".join(part.get("text") or "" for part in self.summary if part.get("type") == "summary_text")

    @property
    def unknown_keys(self) -> list[str]:
        """Its own unknown keys and its text parts' (``content[].KEY``)."""
        return [*super().unknown_keys, *_part_keys("content", self.content)]


# each item type's model, under a capitalised tag (error locations leave such union members out: input[1].name)
SUPPORTED_ITEMS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput",
                   "reasoning": "Reasoning"}


def _typed_item(value: Any) -> Any:
    """An input item with its type: a bare ``{"role", "content"}`` is a message (OpenAI's easy input message); a
    type this server does not take is refused by name."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        if kind not in SUPPORTED_ITEMS:
            raise ValueError(f"input items of type {kind!r} are not supported here: send "
                             f"{', '.join(SUPPORTED_ITEMS)} items")
        return {**value, "type": kind}
    raise ValueError(f"input items must be objects (a message, or an item with its type), not "
                     f"{type(value).__name__}")


def _item_tag(value: Any) -> str | None:
    return SUPPORTED_ITEMS.get(value.get("type")) if isinstance(value, dict) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")] | Annotated[ReasoningItem, Tag("Reasoning")],
    Discriminator(_item_tag), BeforeValidator(_typed_item)]


class FunctionTool(FunctionDefinition):
    """A function tool as the Responses API declares it: the function's fields beside its type (and what OpenAI's
    tool search and code callers read, which change nothing here: every tool is loaded, and the model calls it)."""

    type: Literal["function"]
    defer_loading: neutral_only(None, False) = Field(None, description="Tool search: not supported.")
    allowed_callers: list[str] | None = None
    output_schema: dict[str, Any] | None = None

    def function(self) -> dict[str, Any]:
        """The function as a chat request's tool declares it (``tools[].function``)."""
        return self.model_dump(include=set(FunctionDefinition.model_fields), exclude_none=True)


def _function_tool(value: Any) -> Any:
    """A tool of a type other than ``function`` (web or file search, ...) refused by name."""
    if isinstance(value, dict) and value.get("type") != "function":
        raise ValueError(f"tools of type {value.get('type')!r} are not supported here (no hosted tools): send "
                         "function tools, {'type': 'function', 'name', 'parameters'}")
    return value


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class AllowedToolsChoice(StrictModel):
    """The allowed_tools choice, as the Responses API shapes it: only the listed tools may be called (``required``:
    one of them must be); the request's tools are all rendered still."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunctionChoice] = Field(min_length=1)


class TextFormat(StrictModel):
    """``text.format``: plain text, any JSON object, or JSON that follows ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="Accepted: the schema is always enforced exactly.")

    @model_validator(mode="after")
    def _json_schema_named_and_given(self) -> TextFormat:
        """OpenAI's rule: a json_schema format has its name and its schema; and a schema only there (another type
        would drop it unread)."""
        missing = [name for name, value in (("name", self.name), ("schema", self.json_schema)) if value is None]
        if self.type == "json_schema" and missing:
            raise ValueError(f"a json_schema format needs {' and '.join(missing)}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f'a schema is only read with type "json_schema", not "{self.type}": send type '
                             '"json_schema" to hold the output to the schema, or drop the schema')
        return self


class TextOptions(StrictModel):
    format: TextFormat | None = None
    verbosity: Verbosity | None = None


class ReasoningOptions(StrictModel):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = Field(None, description="Accepted and ignored: no obfuscation padding.")


class ResponsesPromptCacheOptions(PromptCacheOptions):
    """The Responses API's ``prompt_cache_options``: chat's, with its longer ``ttl`` and its diagnostics; ``prewarm``
    (a cache filled and no answer) only false, as every request here is answered."""

    ttl: Literal["30m", "12h"] | None = None
    comparison_response_id: str | None = None
    prewarm: neutral_only(None, False) = Field(None, description="Prewarming alone, without an answer: not "
                                                                 "supported.")


class ResponsesRequest(SamplingExtensions):
    """``POST /v1/responses``: one answer to ``input`` (a text, or the conversation as items), through the chat
    template, without state kept between requests; vLLM's sampling extensions and ``chat_template_kwargs`` as in
    chat."""

    model: str | None = Field(None, description="The served model's id (see /v1/models); default: that model.")
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = Field(None, description="A system message before the input.")
    max_output_tokens: Int | None = Field(None, ge=1, description="Default: what is left of the context.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[Annotated[FunctionTool, BeforeValidator(_function_tool)]] | None = Field(
        None, description="Function tools (no hosted tools).")
    tool_choice: tool_choice_of(NamedFunctionChoice, AllowedToolsChoice) | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call.")
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = Field(None, description='effort is the chat template\'s reasoning_effort '
                                               '(chat\'s), and "none" also sets its enable_thinking false (Qwen3\'s) '
                                               'unless chat_template_kwargs sets it; summary is ignored (named in '
                                               'Kiln-Ignored-Fields).')
    chat_template_kwargs: ChatTemplateKwargs = None
    truncation: neutral_only(None, "disabled", "auto") = Field(None, description="Either way, a prompt longer than "
                                                                                 "the context is a 400.")
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = Field(
        None, description="message.output_text.logprobs: each output token's log probability (and top_logprobs "
                          "alternatives); reasoning.encrypted_content is accepted and ignored: reasoning "
                          "items (with a reasoning parser) carry their text, never encrypted.")
    top_logprobs: Int | None = Field(None, ge=0, le=20, description="Alternatives a token, with "
                                                                    "include message.output_text.logprobs.")
    max_tool_calls: Int | None = Field(None, ge=1, description="At most this many function calls: the first the "
                                                               "model writes (1: as parallel_tool_calls false).")
    background: neutral_only(None, False) = None
    previous_response_id: Unsupported = Field(None, description=STATELESS)
    conversation: Unsupported = Field(None, description=STATELESS)
    prompt: Unsupported = Field(None, description="Stored prompt templates are not supported.")
    moderation: Moderation = None
    # fields that do not change what is generated: accepted, and named in the ignored-fields header
    user: str | None = None
    store: bool | None = Field(None, description="Accepted: nothing is stored (true is named as ignored).")
    metadata: dict[str, str] | None = None
    service_tier: ServiceTier | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: PromptCacheRetention | None = None
    prompt_cache_options: ResponsesPromptCacheOptions | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []
    logprobs: list = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A reasoning model's thought (with a reasoning parser), as vLLM's Responses API returns it: its text as
    content, no summary."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = []
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # the prompt's tokens the prefix cache held
    cache_write_tokens: int = 0  # nothing is written to a billed cache here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """Why a response failed (``status`` "failed"), as OpenAI's API says it."""

    code: Literal["server_error", "invalid_prompt"]
    message: str


class ResponseObject(BaseModel):
    """The response object, as OpenAI's API returns it (the request's settings echoed)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict]
    tool_choice: str | dict
    parallel_tool_calls: bool
    text: dict
    truncation: Literal["disabled", "auto"] = "disabled"
    metadata: dict[str, str]
    store: Literal[False] = False
    background: Literal[False] = False
    previous_response_id: None = None
    reasoning: dict | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    usage: ResponseUsage | None = None
