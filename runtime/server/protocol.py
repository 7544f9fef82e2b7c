"""OpenAI-shaped request and response bodies: strict request models (a wrong type is a 400 naming the field)."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from kiln.runtime.chat_template import TEXT_PARTS, message_content

MAX_STOP_STRINGS = 64  # OpenAI takes 4; vLLM any number, and eval harnesses send more than 4
MAX_STOP_TOKEN_IDS = 1024  # vLLM takes any number: a million ids copied into each of n=128 choices stalled the server
MAX_N = 128
MAX_LOGPROBS = 20  # alternatives per token: OpenAI allows 20 (chat) and 5 (completions); vLLM 20 for both
# Fields accepted for compatibility that change nothing here; a request that sets one is logged once per field.
IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                            "prompt_cache_retention", "prompt_cache_options", "verbosity", "prediction",
                            "guided_decoding_backend"})
SEED_RANGE = (-(2**63), 2**63 - 1)
# The values OpenAI's API takes for its enum fields (openai-python 3.60): another is a 400 there
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Verbosity = Literal["low", "medium", "high"]
PromptCacheRetention = Literal["in_memory", "24h"]


class StrictModel(BaseModel):
    """Unknown fields and wrong JSON types are errors, as in OpenAI's API (no "5" for 5, no 1 for true); a null is
    the field's default, as OpenAI's nullable fields have it ("n": null is 1, "stream": null is false)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None or key not in cls.model_fields or cls.model_fields[key].is_required()}


def _integral(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer: accept it as 2 (strings and 2.5 stay errors)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


def _prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """A prompt is text, a token-id list, or a batch of either; no list in it may be empty (an empty text is the
    tokenizer's BOS alone, as OpenAI and vLLM take it, and refused where the tokenizer adds none). Token ids may be
    integral floats (2.0), as every integer field takes them."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, a non-empty list of strings, of token ids or of token-id lists")
    value = [[_integral(t) for t in p] if isinstance(p, list) else _integral(p) for p in value]
    if _is_token_ids(value):
        return value
    if all(isinstance(p, str) for p in value) or all(isinstance(p, list) and p and _is_token_ids(p) for p in value):
        return value
    ids = [t for p in value for t in (p if isinstance(p, list) else [p])]
    if negative := [t for t in ids if isinstance(t, int) and not isinstance(t, bool) and t < 0]:
        raise ValueError(f"token ids are >= 0, got {negative[0]}")
    if [] in value:
        raise ValueError(f"entry {value.index([])} is an empty token-id list")
    if odd := [t for t in ids if not isinstance(t, (str, int)) or isinstance(t, bool)]:
        raise ValueError(f"token ids are integers, got {odd[0]!r}")
    raise ValueError("mixes strings, token ids and token-id lists: send a string, a list of strings, a list of token "
                     "ids or a list of token-id lists")


def _is_token_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError("must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"accepts at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    return stops


def neutral_only(*allowed: Any) -> Any:
    """A field this server does not implement, accepted only at its neutral values (what clients send unset)."""

    def check(value: Any) -> Any:
        if not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
            raise ValueError(f"is not supported by this server: omit it or send "
                             f"{' or '.join(json.dumps(a) for a in allowed)}")
        return value

    return Annotated[Any, PlainValidator(check), WithJsonSchema({"enum": list(allowed)})]


NoSuffix = neutral_only(None, "")
TextModalities = neutral_only(None, ["text"])
Unsupported = neutral_only(None)
NoAnnotations = neutral_only(None, [])
# OpenAI's hosted moderation, which chat completions and the Responses API take: null only
Moderation = Annotated[Unsupported, Field(description="OpenAI's hosted moderation: not run here.")]
VLLM_DEFAULT = "Extension (as in vLLM): accepted at its default only."


def _logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids (as JSON object keys, so strings) to a bias in [-100, 100]."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object mapping token ids to a bias in [-100, 100]")
    bias = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.isdecimal()):
            raise ValueError(f"keys must be token ids, got {key!r}")
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not -100 <= number <= 100:
            raise ValueError(f"values must be numbers in [-100, 100], got {number!r} for token {key}")
        bias[int(key)] = float(number)
    return bias


LogitBias = Annotated[Any, PlainValidator(_logit_bias), WithJsonSchema({
    "type": ["object", "null"], "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})]

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
Prompt = Annotated[Any, PlainValidator(_prompt), WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
    _TOKEN_IDS,
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
]})]
Stop = Annotated[Any, PlainValidator(_stop), WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
    {"type": "null"},
]})]
def _checked_content(content: Any) -> Any:
    """A message's content checked as chat templates take it (``message_content``'s errors) and kept as sent: its
    parts' other keys reach no template (``template_message`` takes their text) and are named
    (``ChatMessage.unknown_keys``)."""
    message_content(content)
    return content


Content = Annotated[Any, PlainValidator(_checked_content), WithJsonSchema({"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"anyOf": [
        {"type": "object", "properties": {"type": {"enum": ["text", "input_text", "output_text"]},
                                          "text": {"type": "string"}},
         "required": ["type", "text"]},
        {"type": "object", "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}},
         "required": ["type", "refusal"]}]}},
    {"type": "null"},
]})]


class JsonSchemaFormat(StrictModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="Accepted: the schema is always enforced exactly.")


def _schema_of_json_schema_type(value: JsonSchemaFormat | None, info: ValidationInfo) -> JsonSchemaFormat | None:
    """A json_schema only with type json_schema: another type would drop it unread."""
    kind = info.data.get("type")
    if value is not None and kind in ("text", "json_object"):
        raise ValueError(f'is only read with type "json_schema", not {json.dumps(kind)}: send type "json_schema" to '
                         "hold the output to the schema, or drop json_schema")
    return value


class ResponseFormat(StrictModel):
    """OpenAI's response_format: text, any JSON object, or JSON that follows ``json_schema.schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Annotated[JsonSchemaFormat | None, AfterValidator(_schema_of_json_schema_type)] = None


def _truncation(value: int) -> int:
    """vLLM's truncate_prompt_tokens: -1 or a count of tokens (0 would keep none)."""
    if value == 0:
        raise ValueError("must be -1 (the longest prompt the model takes) or at least 1 (the prompt tokens to keep)")
    return value


TruncatePromptTokens = Annotated[Int, Field(ge=-1), AfterValidator(_truncation)]


def _best_of_n(value: int, info: ValidationInfo) -> int:
    """vLLM's best_of, taken where it changes nothing: every sample is returned, so best_of n (as the runtime's
    SamplingParams takes it); fewer is refused, as OpenAI and vLLM refuse it, and more would pick the best of more
    samples than are returned."""
    n = info.data.get("n", 1)
    if value < n:
        raise ValueError(f"best_of ({value}) must be greater than or equal to n ({n})")
    if value > n:
        raise ValueError(f"{value} is not supported by this server, which returns every sample: omit it or send "
                         f"null or {n} (n)")
    return value


BestOf = Annotated[Int, Field(ge=1), AfterValidator(_best_of_n)]


class StructuredOutputs(StrictModel):
    """vLLM's structured_outputs extension: exactly one format."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = Field(None, description="A Lark grammar (llguidance's dialect), or GBNF.")
    choice: list[str] | None = None
    # vLLM's options, at what this server always does: JSON without optional whitespace, objects closed to the keys
    # their schema names (False would ask for what it never does)
    disable_any_whitespace: neutral_only(None, True) = Field(
        None, description="Extension (as in vLLM): always true here.")
    disable_additional_properties: neutral_only(None, True) = Field(
        None, description="Extension (as in vLLM): always true here.")
    disable_fallback: bool | None = Field(None, description="Extension (as in vLLM): one grammar engine here, no "
                                                            "fallback.")


class StreamOptions(StrictModel):
    include_usage: bool = False
    include_obfuscation: bool | None = Field(None, description="Accepted and ignored: no obfuscation padding.")
    continuous_usage_stats: bool | None = Field(None, description="Extension (as in vLLM): with include_usage, "
                                                                  "every chunk carries its choice's usage so far.")


class PromptCacheOptions(StrictModel):
    """Chat's ``prompt_cache_options``, in the shape OpenAI's API takes (openai-python 3.63): accepted and ignored,
    as this server's prefix cache needs no options."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


def shared_ignored_fields(request: BaseModel, store: bool | None, stream_options: BaseModel | None) -> set[str]:
    """What the APIs share of the fields a request set that change nothing, as the ignored-fields header names them:
    those of IGNORED_FIELDS (``store`` only when true: nothing is stored either way), ``include_obfuscation`` true
    (no obfuscation padding is sent) and ``continuous_usage_stats`` true without ``include_usage`` (no usage to
    send)."""
    names = request.model_fields_set & IGNORED_FIELDS
    if store is False:
        names.discard("store")
    if stream_options is not None:
        usage = getattr(stream_options, "include_usage", None)
        names.update(f"stream_options.{name}" for name, unheard in (
            ("include_obfuscation", stream_options.include_obfuscation),
            ("continuous_usage_stats", getattr(stream_options, "continuous_usage_stats", None) and not usage))
            if unheard)
    return names


def _continue_final_message(value: bool, info: ValidationInfo) -> bool:
    """vLLM's continue_final_message: only without the generation prompt, and only after an assistant message."""
    if not value:
        return value
    if info.data.get("add_generation_prompt", True):
        raise ValueError("needs add_generation_prompt: false (the completion continues the final message rather "
                         "than starting a new one)")
    messages = info.data.get("messages")
    if messages and messages[-1].role != "assistant":
        raise ValueError(f"continues the final message, which must be the assistant's, not the {messages[-1].role}'s")
    return value


AddGenerationPrompt = Annotated[bool, Field(description="Extension (as in vLLM): end with the assistant's turn "
                                                        "header; false: the messages alone.")]
ContinueFinalMessage = Annotated[bool, AfterValidator(_continue_final_message), Field(
    description="Extension (as in vLLM): with add_generation_prompt false, the completion continues the final "
                "(assistant) message, as transformers' apply_chat_template(continue_final_message=True) renders it.")]

# vLLM's chat_template_kwargs, which chat completions and the Responses API take
ChatTemplateKwargs = Annotated[dict[str, Any] | None, Field(
    description='Extension (as in vLLM): more variables for the chat template, e.g. {"enable_thinking": false} for '
                'Qwen3.')]


class SamplingExtensions(StrictModel):
    """vLLM's sampling extensions (and OpenAI's seed, stop and penalties), which every generation request takes:
    completions, chat completions and the Responses API."""

    top_k: Int | None = Field(None, ge=-1, description="Extension (as in vLLM): keep the k most likely tokens.")
    min_p: float | None = Field(None, ge=0, le=1, description="Extension (as in vLLM): drop the tokens less likely "
                                                              "than min_p times the most likely one.")
    seed: Int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Stop = None
    ignore_eos: bool = Field(False, description="Extension (as in vLLM): generate max_tokens whatever the EOS.")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: LogitBias = None
    repetition_penalty: float | None = Field(None, ge=0.01, le=100,
                                             description="Extension (as in vLLM): transformers' rule.")
    min_tokens: Int | None = Field(None, ge=0, description="Extension (as in vLLM): no EOS or stop token before.")
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description=f"Extension (as in vLLM); at most {MAX_STOP_TOKEN_IDS}.")
    structured_outputs: StructuredOutputs | None = Field(None, description="Extension (as in vLLM): hold the "
                                                         "output to a JSON schema, a regex, a grammar or a choice.")
    request_id: str | None = Field(None, min_length=1, max_length=256, description="Extension (as in vLLM): the "
                                   "request's id, which names its response, where no X-Request-Id header does.")


class SamplingFields(SamplingExtensions):
    """What completions and chat completions share."""

    model: str | None = Field(None, description="The served model's id (see /v1/models); default: that model.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, ge=0, le=1)
    n: Int = Field(1, ge=1, le=MAX_N, description="Completions per prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="Extension (as in vLLM): log probabilities of the prompt tokens.")
    # structured_outputs under vLLM's names before 0.11 (deprecated there; clients of that era send them)
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's structured_outputs.json before 0.11.")
    guided_regex: str | None = Field(None, description="vLLM's structured_outputs.regex before 0.11.")
    guided_choice: list[str] | None = Field(None, description="vLLM's structured_outputs.choice before 0.11.")
    guided_grammar: str | None = Field(None, description="vLLM's structured_outputs.grammar before 0.11.")
    guided_decoding_backend: str | None = Field(None, description="Accepted and ignored: one grammar engine here.")
    guided_whitespace_pattern: Unsupported = None
    response_format: ResponseFormat | None = None
    include_stop_str_in_output: bool = Field(False, description="Extension (as in vLLM): a stop string that ends "
                                                                "the completion stays at the end of its text.")
    return_tokens_as_token_ids: bool = Field(False, description='Extension (as in vLLM): logprobs name each token '
                                                                '"token_id:{id}" rather than by its text.')
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(
        None, description="Extension (as in vLLM): keep only the prompt's last k tokens (after the chat template); "
                          "-1: as many as the model takes.")
    # vLLM's extensions at their defaults, which is what Kiln does (clients written for vLLM send them)
    skip_special_tokens: bool = Field(True, description="Extension (as in vLLM): false keeps the special tokens the "
                                                        "model generates in the text (not the EOS that ends it).")
    spaces_between_special_tokens: neutral_only(None, True) = Field(None, description=VLLM_DEFAULT)
    priority: neutral_only(None, 0) = Field(None, description=VLLM_DEFAULT)
    use_beam_search: neutral_only(None, False) = Field(None, description=VLLM_DEFAULT)
    length_penalty: neutral_only(None, 1.0) = Field(None, description=VLLM_DEFAULT)
    return_token_ids: neutral_only(None, False) = Field(None, description=VLLM_DEFAULT)
    allowed_token_ids: list[Annotated[Int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="Extension (as in vLLM): sample only among these token ids.")
    bad_words: NoAnnotations = Field(None, description=VLLM_DEFAULT)
    # OpenAI fields that do not change what is generated: accepted, and logged once as ignored
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: ServiceTier | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def ignored_fields(self) -> list[str]:
        """The accepted-and-ignored fields this request set, sorted: ``store`` only when true (nothing is stored
        either way), and the ``stream_options`` that ask for what no stream here sends."""
        return sorted(shared_ignored_fields(self, self.store, self.stream_options))

    def guided_outputs(self) -> StructuredOutputs | None:
        """The ``structured_outputs`` that the guided_* fields (vLLM's names before 0.11) ask for, if any."""
        guided = {key: value for key, value in (("json", self.guided_json), ("regex", self.guided_regex),
                                                ("choice", self.guided_choice), ("grammar", self.guided_grammar))
                  if value is not None}
        return StructuredOutputs.model_validate(guided) if guided else None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Int | None = Field(None, ge=0, description="Default 16; 0 with echo: the prompt alone, scored.")
    echo: bool | None = Field(None, description="Return the prompt before the completion (with its log "
                                                 "probabilities when logprobs is set).")
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="The most likely alternatives per token.")
    best_of: BestOf | None = Field(None, description="null or n: every sample is returned.")
    suffix: NoSuffix = None
    add_special_tokens: bool | None = Field(None, description="Extension (as in vLLM): add the tokenizer's special "
                                                              "tokens (BOS) to a text prompt; default true. False "
                                                              "for a prompt that writes them itself.")


class FunctionCall(StrictModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class CalledFunction(FunctionCall):
    """An earlier call's function as the openai client returns it: its ``parse``/``stream`` helpers add the
    arguments parsed (``parsed_arguments``), which a message passed back keeps and the template does not need; a key
    this server does not know ignored, as on a message."""

    model_config = ConfigDict(extra="allow")

    parsed_arguments: Any = Field(None, exclude=True)


class ToolCallMessagePart(StrictModel):
    """An assistant's earlier call: a key this server does not know, on it or its function, ignored as on a message
    (vLLM takes calls as OpenAI's TypedDicts, which ignore them; LiteLLM adds ``provider_specific_fields``)."""

    model_config = ConfigDict(extra="allow")

    index: Int | None = Field(None, exclude=True, description="The position a streamed call had in its chunks, which "
                                                               "the openai client's stream helpers keep: ignored.")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    @property
    def unknown_keys(self) -> list[str]:
        """The keys the call and its function were sent with that this server does not know (``function.KEY``)."""
        return [*(self.model_extra or ()), *(f"function.{key}" for key in self.function.model_extra or ())]


class ChatMessage(StrictModel):
    """A message of the conversation: its known fields as strict as the request's, a key this server does not know
    ignored (as vLLM takes messages; LiteLLM passes its answers back with ``provider_specific_fields``), on it, its
    tool calls or its content parts: never given to the template, its name in ``unknown_keys`` for the request to
    name."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "ipython"]  # ipython: Llama 3.1's tool output
    content: Content = None
    name: str | None = None
    tool_calls: list[ToolCallMessagePart] | None = Field(None, description="An assistant's earlier calls.")
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")
    refusal: str | None = Field(None, description="An assistant's earlier refusal: its text when content is empty.")
    reasoning_content: str | None = Field(None, description="An assistant's earlier reasoning (DeepSeek's and "
                                                            "vLLM's name), given to the template, which may show it.")
    reasoning: str | None = Field(None, description="The same, by vLLM's newer name.")
    # what an assistant message of an openai client's response holds, passed back unchanged (message.model_dump())
    annotations: NoAnnotations = None
    parsed: Any = Field(None, exclude=True, description="What the openai client's parse helpers parsed the content "
                                                       "into: taken with the message, not rendered.")
    audio: Unsupported = Field(None, description="An earlier audio answer: not supported.")
    function_call: Unsupported = Field(None, description="Deprecated by OpenAI: send tool_calls.")
    type: Literal["text", "message"] | None = Field(
        None, exclude=True, description='Ignored: lm-evaluation-harness\'s chat models send "type": "text" on every '
                                        'message, and the Responses API\'s items "message".')

    @property
    def unknown_keys(self) -> list[str]:
        """The keys the message was sent with that this server does not know (ignored): its own, its tool calls'
        (``tool_calls[].KEY``, ``tool_calls[].function.KEY``) and its content parts' (``content[].KEY``, dropped
        as vLLM drops them: Anthropic-style clients send ``cache_control``)."""
        calls = (f"tool_calls[].{key}" for call in self.tool_calls or () for key in call.unknown_keys)
        parts = self.content if isinstance(self.content, list) else ()
        dropped = (f"content[].{key}" for part in parts for key in part
                   if key not in ("type", TEXT_PARTS[part["type"]]))
        return [*(self.model_extra or ()), *dict.fromkeys(calls), *dict.fromkeys(dropped)]

    @model_validator(mode="after")
    def _tool_call_id_on_tool_messages_only(self) -> ChatMessage:
        """OpenAI's rule: a tool message names the call it answers, and no other message names one."""
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs the tool_call_id of the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"tool_call_id belongs on a 'tool' message, not on a '{self.role}' message")
        return self


class FunctionDefinition(StrictModel):
    # OpenAI's names ([a-zA-Z0-9_-]{1,64}) and what vLLM also takes, as MCP servers name tools (server.tool, longer
    # prefixed names): at most 256 characters, none of them whitespace, a quote, a backslash or an angle bracket (a
    # call's JSON would escape them, and a template's tags hold them)
    name: str = Field(pattern=r'^[^\s"\\<>]{1,256}$')
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments.")
    strict: bool | None = Field(None, description="Accepted: forced calls always follow the schema exactly.")

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        """OpenAI's rule: a function takes an object of named arguments (templates write, and call parsers read,
        arguments as one)."""
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError(f'must be a JSON schema of "type": "object" (a function takes named arguments), got '
                             f'"type": {json.dumps(parameters["type"])}')
        return parameters


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"  # vLLM's default: {"function": {"name": ...}} names one too
    function: NamedFunction


class AllowedTools(StrictModel):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1, description="The tools that may be called, by name.")


class AllowedToolChoice(StrictModel):
    """OpenAI's allowed_tools choice: only the listed tools may be called (``required``: one of them must be); the
    request's tools are all rendered still."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def _tool_choice_tag(value: Any) -> str:
    """The shape of a tool choice: an object of type allowed_tools, another object (a named function), else a mode."""
    if isinstance(value, dict):
        return "AllowedTools" if value.get("type") == "allowed_tools" else "Named"
    return "Mode"


def tool_choice_of(named: type, allowed: type) -> Any:
    """A ``tool_choice``: a mode, a named function (``named``) or allowed tools (``allowed``), told apart by shape
    so that an error names the field of the shape sent (``tool_choice.allowed_tools.mode``)."""
    return Annotated[Annotated[Literal["none", "auto", "required"], Tag("Mode")] | Annotated[named, Tag("Named")]
                     | Annotated[allowed, Tag("AllowedTools")], Discriminator(_tool_choice_tag)]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1, description="Default: what is left of the context.")
    max_completion_tokens: Int | None = Field(None, ge=1, description="Takes precedence over max_tokens.")
    logprobs: bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Needs logprobs: true.")
    tools: list[Tool] | None = None
    tool_choice: tool_choice_of(NamedToolChoice, AllowedToolChoice) | None = None
    modalities: TextModalities = None
    audio: Unsupported = Field(None, description="Audio output: not supported.")
    functions: Unsupported = Field(None, description="Deprecated by OpenAI: send tools.")
    function_call: Unsupported = Field(None, description="Deprecated by OpenAI: send tool_choice.")
    web_search_options: Unsupported = Field(None, description="Web search: not supported.")
    prompt_cache_retention: PromptCacheRetention | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    moderation: Moderation = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call.")
    chat_template_kwargs: ChatTemplateKwargs = None
    documents: list[dict[str, str]] | None = Field(
        None, description='Extension (as in vLLM): documents for a RAG chat template, each a dict of strings (say '
                          '"title" and "text"), passed as its documents variable, as transformers passes them.')
    reasoning_effort: ReasoningEffort | None = Field(
        None, description='The chat template\'s reasoning_effort variable (as in vLLM); "none" also sets its '
                          'enable_thinking false (Qwen3\'s), unless chat_template_kwargs sets it.')
    include_reasoning: bool = Field(True, description="Extension (as in vLLM): false leaves the reasoning that "
                                    "kiln serve --reasoning-parser separates out of the response.")
    verbosity: Verbosity | None = None
    prediction: dict[str, Any] | None = None
    add_generation_prompt: AddGenerationPrompt = True
    continue_final_message: ContinueFinalMessage = False
    add_special_tokens: neutral_only(None, False) = Field(None, description=VLLM_DEFAULT)
    echo: neutral_only(None, False) = Field(None, description=VLLM_DEFAULT)

    def ignored_fields(self) -> list[str]:
        """As SamplingFields', and the keys of messages (of their tool calls and content parts too) this server does
        not know, once each whichever messages carry them (``messages[].provider_specific_fields``,
        ``messages[].tool_calls[].function.KEY``, ``messages[].content[].cache_control``)."""
        keys = {f"messages[].{key}" for message in self.messages for key in message.unknown_keys}
        return sorted(keys.union(super().ignored_fields()))


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = Field(0, exclude=True)  # of the prompts, held by the prefix cache (the Responses API's)


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists over the tokens (the prompt's first, with ``echo``)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    def extend(self, more: CompletionLogprobs) -> CompletionLogprobs:
        """These lists followed by ``more``'s (self, extended)."""
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self, name).extend(getattr(more, name))
        return self


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = Field(None, description="Extension (as in vLLM): the stop string or stop token "
                                                            "id that ended the choice (null for EOS and length).")
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning: str | None = Field(None, description="The model's thinking, with a reasoning parser (vLLM's name).")
    reasoning_content: str | None = Field(None, description="The same, by its older name (DeepSeek's, vLLM's "
                                                            "before 0.11).")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = Field(None, description="Extension (as in vLLM): the stop string or stop token "
                                                            "id that ended the choice (null for EOS and length).")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class ModelPermission(BaseModel):
    """vLLM's permission entry of a model card (OpenAI's old shape): sampling and logprobs allowed, nothing else."""

    id: str
    object: Literal["model_permission"] = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """OpenAI's model object, with the engine's context (``max_model_len``, as vLLM gives it), the longest prompt
    it takes (``max_input_len``: the engine's plan may hold less than the context less one token) and the
    vocabulary its token ids come from (``vocab_size``: what a client sending token-id prompts needs). ``root`` and
    ``parent`` as vLLM's cards give them: the model an alias serves, and no base model (no adapters here)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kiln"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    max_input_len: int | None = None
    vocab_size: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list, description="As vLLM's cards have it.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = Field(None, description="Add the tokenizer's special tokens (BOS); default: "
                                                              "true for a prompt, false for messages (the template "
                                                              "writes its own), as vLLM does.")
    add_generation_prompt: AddGenerationPrompt = True
    continue_final_message: ContinueFinalMessage = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="For messages: more variables for the "
                                                                          "chat template, as in chat completions.")
    return_token_strs: bool = Field(False, description="Also each token as its vocabulary spells it (token_strs).")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Annotated[Int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
