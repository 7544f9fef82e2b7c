"""OpenAI-shaped request and response bodies: strict request models (a wrong type is a 400 naming the field)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, WithJsonSchema

MAX_STOP_STRINGS = 4
MAX_N = 128
SEED_RANGE = (-(2**63), 2**63 - 1)


class StrictModel(BaseModel):
    """Unknown fields and wrong JSON types are errors, as in OpenAI's API (no "5" for 5, no 1 for true)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _integral(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer: accept it as 2 (strings and 2.5 stay errors)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


def _prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """A prompt is text, a token-id list, or a batch of either; nothing in it may be empty."""
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be empty")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty string, list of strings, list of token ids or list of token-id lists")
    if _is_token_ids(value):
        return value
    if all(isinstance(p, str) and p for p in value) or all(isinstance(p, list) and p and _is_token_ids(p)
                                                          for p in value):
        return value
    raise ValueError("must be a non-empty string, list of strings, list of token ids or list of token-id lists "
                     "(with no empty entries)")


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


def _content(value: Any) -> str:
    """Message content: a string, or a list of text parts (joined); images and audio are not supported."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("parts must be {'type': 'text', 'text': str}: only text content is supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError("must be a string or a list of text parts")


def _only(*allowed: Any) -> Any:
    """A field this server does not implement, accepted only at its neutral values (what clients send unset)."""

    def check(value: Any) -> Any:
        if not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
            raise ValueError(f"is not supported by this server: omit it or send {' or '.join(map(repr, allowed))}")
        return value

    return Annotated[Any, PlainValidator(check), WithJsonSchema({"enum": list(allowed)})]


NoPenalty = _only(None, 0)
NoLogitBias = _only(None, {})
NoLogprobs = _only(None, False)  # chat: a boolean
NoCompletionLogprobs = _only(None)  # completions: a count
NoEcho = _only(None, False)
OneBestOf = _only(None, 1)
NoSuffix = _only(None, "")
NoTopLogprobs = _only(None, 0)
TextResponseFormat = _only(None, {"type": "text"})

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
Content = Annotated[Any, PlainValidator(_content), WithJsonSchema({"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                                "required": ["type", "text"]}},
    {"type": "null"},
]})]


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """What completions and chat completions share."""

    model: str | None = Field(None, description="The served model's id (see /v1/models); default: that model.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: Int | None = Field(None, ge=-1, description="Extension (as in vLLM): keep the k most likely tokens.")
    n: Int = Field(1, ge=1, le=MAX_N, description="Completions per prompt.")
    seed: Int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="Extension (as in vLLM): generate max_tokens whatever the EOS.")
    presence_penalty: NoPenalty = None
    frequency_penalty: NoPenalty = None
    logit_bias: NoLogitBias = None
    user: str | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Int | None = Field(None, ge=1, description="Default 16.")
    echo: NoEcho = None
    logprobs: NoCompletionLogprobs = None
    best_of: OneBestOf = None
    suffix: NoSuffix = None


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1, description="Default: what is left of the context.")
    max_completion_tokens: Int | None = Field(None, ge=1, description="Takes precedence over max_tokens.")
    logprobs: NoLogprobs = None
    top_logprobs: NoTopLogprobs = None
    response_format: TextResponseFormat = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    """OpenAI's model object, with the engine's context (``max_model_len``, as vLLM gives it) and the vocabulary its
    token ids come from (``vocab_size``: what a client sending token-id prompts needs)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kiln"
    max_model_len: int | None = None
    vocab_size: int | None = None


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
