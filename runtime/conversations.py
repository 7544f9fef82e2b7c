"""`LLM.chat`'s input: vLLM's chat messages (one conversation, or a list of them) rendered through the engine's chat
template into prompt token ids, as vLLM's ``LLM.chat`` renders them."""

from __future__ import annotations

import logging
from collections import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.runtime.errors import InvalidRequestError

logger = logging.getLogger("kiln.runtime")

if TYPE_CHECKING:  # jinja2 is imported only when a chat is rendered
    from kiln.runtime.chat_template import ChatTemplate
    from kiln.runtime.chat_template_files import ChatTemplateFiles
    from kiln.runtime.tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


class ChatInputError(InvalidRequestError):
    """Messages `LLM.chat` cannot render: a malformed message, no chat template, or one that refuses them."""


def as_conversations(messages: abc.Sequence) -> list[list[Mapping[str, Any]]]:
    """One conversation (a list of message dicts) or several (a list of such lists), as a list of conversations."""
    if isinstance(messages, str | Mapping) or not isinstance(messages, abc.Sequence) or not messages:
        raise ChatInputError("messages must be a non-empty list of message dicts ({'role': ..., 'content': ...}), or "
                             f"a list of such lists (one per conversation); got {_kind(messages)}")
    if isinstance(messages[0], Mapping):
        _check_messages(messages, "")
        return [list(messages)]
    for index, conversation in enumerate(messages):
        if isinstance(conversation, str | Mapping) or not isinstance(conversation, abc.Sequence) or not conversation:
            raise ChatInputError(f"messages[{index}]: each conversation is a non-empty list of message dicts; got "
                                 f"{_kind(conversation)}")
        _check_messages(conversation, f"messages[{index}]: ")
    return [list(conversation) for conversation in messages]


def _check_messages(conversation: abc.Sequence, where: str) -> None:
    for position, message in enumerate(conversation):
        if not isinstance(message, Mapping):
            raise ChatInputError(f"{where}message {position} is a {_kind(message)}, not a message dict "
                                 "({'role': ..., 'content': ...})")


def load_template(files: ChatTemplateFiles | None, source: str | None) -> ChatTemplate:
    """The chat template ``files`` hold (an engine's, read at its load: its named ones too), or ``source`` in its
    place (with their special tokens): a template, or the name of one of the engine's named templates."""
    from kiln.runtime.chat_template import ChatTemplate, ChatTemplateError, check_template_source

    if source is not None and not source.strip():
        raise ChatInputError("chat_template is empty: pass a template's source, or leave it out for the engine's own")
    if files is None:
        if source is None:
            raise ChatInputError("this LLM was not loaded from an engine directory, so it has no chat template: pass "
                                 "chat_template=")
        try:
            check_template_source(source)
        except ChatTemplateError as exc:
            raise ChatInputError(str(exc)) from None
        return ChatTemplate(source, {})
    try:
        template = ChatTemplate.from_files(files, source)
    except ChatTemplateError as exc:
        raise ChatInputError(str(exc)) from None
    if template is None:
        raise ChatInputError(f"{files.directory} has no chat template (neither chat_template.jinja nor "
                             "tokenizer_config.json holds one): pass chat_template=, or render the prompt yourself "
                             "and call generate")
    return template


def render_prompts(conversations: list[list[Mapping[str, Any]]], template: ChatTemplate, tokenizer: Tokenizer | None,
                   *, add_generation_prompt: bool, continue_final_message: bool,
                   tools: abc.Sequence[Mapping[str, Any]] | None,
                   chat_template_kwargs: Mapping[str, Any] | None) -> list[tuple[str, list[int]]]:
    """Each conversation's prompt text and token ids: rendered by ``template`` (its ``tool_use`` one when ``tools``
    are given and it has one, as transformers and vLLM pick it; it writes BOS itself) and tokenized without special
    tokens, as vLLM and transformers tokenize a rendered chat."""
    from kiln.runtime.chat_template import ChatTemplateError

    if tokenizer is None:
        raise ChatInputError("this engine has no tokenizer.json, so it cannot tokenize a rendered chat: pass token ids "
                             "to generate")
    tools = None if tools is None else list(tools)
    try:
        template = template.for_tools(tools)
    except ChatTemplateError as exc:  # named templates without a default, and no tools
        raise ChatInputError(str(exc)) from None
    if tools and "tools" not in template.reads:
        raise ChatInputError("the chat template does not render tools, so the model cannot call them: pass no tools")
    if unread := [name for name in chat_template_kwargs or {} if name not in template.reads]:
        logger.warning("chat_template_kwargs %s: the chat template never reads them", ", ".join(map(repr, unread)))
    if add_generation_prompt and continue_final_message:
        raise ChatInputError("continue_final_message needs add_generation_prompt=False: the completion continues the "
                             "final message rather than starting a new one")
    prompts = []
    for index, conversation in enumerate(conversations):
        where = f"messages[{index}]: " if len(conversations) > 1 else ""
        try:
            rendered = [_template_message(message, position) for position, message in enumerate(conversation)]
            variables = dict(chat_template_kwargs or {})
            text, dropped = template.render_with_calls(rendered, add_generation_prompt, tools, variables,
                                                       continue_final_message)
        except (ChatInputError, ChatTemplateError) as exc:
            raise ChatInputError(f"{where}{exc}") from None
        if dropped is not None:
            raise ChatInputError(f"{where}the chat template does not render tool calls, so those of message {dropped} "
                                 f"would be left out of the prompt: pass the conversation without them, or a "
                                 f"chat_template that renders them")
        prompts.append((text, tokenizer.encode(text, add_special_tokens=False)))
    return prompts


def _template_message(message: Mapping[str, Any], position: int) -> dict:
    """A message as chat templates take it (``chat_template.template_message``), its role and content checked."""
    from kiln.runtime.chat_template import template_message

    role = message.get("role")
    if role not in ROLES:
        raise ChatInputError(f"message {position}: role must be one of {', '.join(ROLES)}; got {role!r}")
    if (role == "tool") != bool(message.get("tool_call_id")):  # OpenAI's rule, as the server checks it
        raise ChatInputError(f"message {position}: a 'tool' message names the tool_call_id of the call it answers, "
                             f"and no other message names one")
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatInputError(f"message {position}: each tool call is {{'type': 'function', 'function': "
                                 f"{{'name': ..., 'arguments': ...}}}}; got {call!r}")
    try:
        return template_message(message)
    except ValueError as exc:  # its content
        raise ChatInputError(f"message {position}: content {exc}") from None


def _kind(value: object) -> str:
    return "an empty list" if isinstance(value, list) and not value else type(value).__name__
