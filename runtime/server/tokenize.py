"""/tokenize, /detokenize, /tokenizer_info and /version, as vLLM serves them: what a client needs to count tokens,
check a chat template's rendering or read token ids back, without generating."""

from __future__ import annotations

from typing import Any

from kiln.runtime.server.chat import render_chat, require_tool_format, template_tools, unread_template_fields
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.generation import ServedModel
from kiln.runtime.server.jobs import check_model
from kiln.runtime.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from kiln.runtime.tokenizer_files import special_token_text
from kiln.runtime.version import kiln_version

# what only messages take, and its values that change nothing
_MESSAGES_ONLY = {"tools": (None, []), "add_generation_prompt": (True,), "continue_final_message": (False,),
                  "chat_template_kwargs": (None, {})}


def tokenize(model: ServedModel, req: TokenizeRequest) -> tuple[TokenizeResponse, list[str]]:
    """Token ids of a prompt or of chat messages, as a generation request would send them to the engine, and the
    request's chat_template_kwargs the template never reads (named in the Kiln-Ignored-Fields header, as chat
    completions name them)."""
    check_model(model, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", param="prompt")
    if req.prompt is not None and (chat_only := [name for name, neutral in _MESSAGES_ONLY.items()
                                                 if getattr(req, name) not in neutral]):
        raise APIError(400, f"{chat_only[0]} applies to messages only: send messages, or leave it out",
                       param=chat_only[0])  # refused, not ignored (at its default, as clients send it, taken)
    if req.messages is not None:
        tools = template_tools(req.tools)
        if tools:  # as chat refuses them
            require_tool_format(model)
        text = render_chat(model, req.messages, tools, req.add_generation_prompt, req.chat_template_kwargs,
                           req.continue_final_message)
        # the template writes BOS itself, unless asked for on top of it
        ids = model.encode(_within_context(model, text, "messages"), "messages",
                           add_special_tokens=bool(req.add_special_tokens))
    else:
        ids = model.encode(_within_context(model, req.prompt, "prompt"), "prompt",
                           add_special_tokens=req.add_special_tokens is not False)
    strings = model.tokenizer.vocabulary_entries(ids) if req.return_token_strs else None  # encode needs a tokenizer
    unread = unread_template_fields(model, req) if req.messages is not None else []
    return TokenizeResponse(count=len(ids), max_model_len=model.limits.max_request_tokens, tokens=ids,
                            token_strs=strings), unread


def detokenize(model: ServedModel, req: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids, special tokens included (as vLLM decodes them: a chat template's rendering reads
    back whole)."""
    check_model(model, req.model)
    if model.tokenizer is None:
        raise APIError(400, "this engine has no tokenizer to decode with", param="tokens")
    if len(req.tokens) > model.limits.max_request_tokens:
        raise APIError(400, f"{len(req.tokens)} token ids are more than this model's context of "
                            f"{model.limits.max_request_tokens} tokens", param="tokens")
    vocab_size = model.limits.vocab_size
    if vocab_size is not None and (outside := [t for t in req.tokens if t >= vocab_size]):
        raise APIError(400, f"token ids {outside[:8]} are outside the vocabulary of {vocab_size} tokens",
                       param="tokens")
    return DetokenizeResponse(prompt=model.tokenizer.decode(req.tokens, skip_special_tokens=False))


def tokenizer_info(model: ServedModel) -> dict[str, Any]:
    """The tokenizer's configuration (``tokenizer_config.json``, each special token as its text) with its class
    and the chat template the server renders (its default one, which renders messages without tools: not a
    ``tool_use`` one beside it): what lm-evaluation-harness's remote tokenizer reads, as vLLM's ``/tokenizer_info``
    gives it."""
    info = {name: _as_text(value) for name, value in model.tokenizer_config.items()}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    info["chat_template"] = model.chat_template.source if model.chat_template is not None else None
    return info


def _as_text(value: Any) -> Any:
    """A tokenizer_config.json value with each added token (``{"content": ..., ...}``) as its text."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return special_token_text(value)
    if isinstance(value, dict):
        return {k: _as_text(v) for k, v in value.items()}
    return [_as_text(item) for item in value] if isinstance(value, list) else value


def _within_context(model: ServedModel, text: str, param: str) -> str:
    """``text``, unless it has more characters than the model's context could hold as tokens (a 400: tokenizing
    megabytes would hold a worker for seconds to count what no request could send)."""
    bound = model.limits.max_request_tokens
    if model.tokenizer is not None and len(text) > bound * model.tokenizer.max_token_bytes:
        raise APIError(400, f"'{param}' has {len(text):,} characters, more than this model's context of {bound} "
                            f"tokens can hold", param=param)
    return text


def server_version() -> VersionResponse:
    """The installed Kiln's version."""
    return VersionResponse(version=kiln_version() or "unknown")  # unknown: run from a checkout never installed
