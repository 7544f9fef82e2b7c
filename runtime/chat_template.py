"""The checkpoint's own chat template, rendered the way Hugging Face tokenizers render it (sandboxed Jinja): for
`LLM.chat` and the server's chat endpoints."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.runtime.chat_template_files import ChatTemplateFiles
from kiln.runtime.errors import KilnError

logger = logging.getLogger("kiln.runtime")


class ChatTemplateError(KilnError):
    """Messages the template refuses (it raised), or a template that does not render."""


class ReservedVariableError(ChatTemplateError):
    """A further template variable that would replace one the server sets (messages, tools, bos_token, ...)."""


class UncontinuableMessageError(ChatTemplateError):
    """``continue_final_message`` with a template that does not write the final message's content verbatim."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which marks the assistant's turns for training on them alone
    (TRL's ``assistant_only_loss``): rendered as its contents, as transformers renders it for a prompt."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` reads the variable ``name`` (its ``key`` item or attribute, with a key), through filters,
    tests and slices, as vLLM's content-format detection reads it."""
    if isinstance(node, (nodes.Filter, nodes.Test)) or (isinstance(node, nodes.Getitem)
                                                       and isinstance(node.arg, nodes.Slice)):
        return node.node is not None and _reads(node.node, name, key)
    if key is not None:
        keyed = ((isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key)
                 or (isinstance(node, nodes.Getattr) and node.attr == key))
        return keyed and _reads(node.node, name)
    return isinstance(node, nodes.Name) and node.name == name


def _loop_names(ast: nodes.Template, names: set[str], key: str | None = None) -> set[str]:
    """The loop variables of the ``for`` loops over one of ``names`` (over its ``key``, with a key)."""
    return {loop.target.name for loop in ast.find_all(nodes.For)
            if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, name, key) for name in names)}


ContentFormat = Literal["string", "parts", "either"]


def _content_format(ast: nodes.Template) -> ContentFormat:
    """How the template takes a message's content: ``parts`` when it loops over it and never tests whether it is a
    string (a VLM-derived template: vLLM's "openai" content format, detected as vLLM does), ``either`` when it loops
    over it and tests for a string too (Llama 3.1's, Qwen2-VL's: content goes as the caller gave it, as transformers
    passes it), else ``string``."""
    messages = {"messages"}
    for assign in ast.find_all(nodes.Assign):  # {% set loop_messages = messages[1:] %}: in document order
        if isinstance(assign.target, nodes.Name) and any(_reads(assign.node, name) for name in messages):
            messages.add(assign.target.name)
    message_names = _loop_names(ast, messages)
    if not _loop_names(ast, message_names, "content"):
        return "string"
    tests_string = any(test.name == "string" and any(_reads(test.node, name, "content") for name in message_names)
                       for test in ast.find_all(nodes.Test))
    return "either" if tests_string else "parts"


def _in_format(message: dict[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    """``message`` with its content as a template of ``content_format`` takes it: text parts joined by newlines for
    ``string`` (as vLLM joins them), a text as one part (none when empty) for ``parts``, as given for ``either``."""
    content = message.get("content")
    if content_format == "string" and isinstance(content, list):
        return {**message, "content": message_text(content)}
    if content_format == "parts" and isinstance(content, str):
        return {**message, "content": [{"type": "text", "text": content}] if content else []}
    return message


TOOL_USE = "tool_use"  # the named template that renders a request with tools, as transformers picks it


class ChatTemplate:
    """Turns OpenAI chat messages into the prompt text the model was trained on: the model's default template, and
    its ``tool_use`` template (where it has one), which renders a request with tools in its place."""

    def __init__(self, source: str | None, special_tokens: dict[str, str], tool_use: ChatTemplate | None = None
                 ) -> None:
        """``source``: the default template (None only beside a ``tool_use`` one: a model whose named templates
        include no default, which renders only a request with tools)."""
        self.source = source
        self.special_tokens = special_tokens
        self.tool_use = tool_use
        self._template: jinja2.Template | None = None
        self.content_format: ContentFormat = "string"  # message content as a string, text parts, or either
        self.reads: frozenset[str] = frozenset()  # the variables it may read
        if source is not None:
            environment = _environment()
            ast = environment.parse(source)
            self._template = environment.from_string(ast)
            self.content_format = _content_format(ast)
            self.reads = frozenset(jinja2.meta.find_undeclared_variables(ast))

    @classmethod
    def from_dir(cls, directory: Path, source: str | None = None) -> ChatTemplate | None:
        """The templates of an engine or checkpoint directory (``ChatTemplateFiles.read``), or ``source`` in their
        place (with the directory's special tokens); None when it has none."""
        return cls.from_files(ChatTemplateFiles.read(directory), source)

    @classmethod
    def from_files(cls, files: ChatTemplateFiles, source: str | None = None) -> ChatTemplate | None:
        """The templates ``files`` hold (the default, and ``tool_use`` for a request with tools), or ``source`` in
        their place with their special tokens: the name of one of them (when they are named) takes that one alone,
        as transformers takes a name; a template replaces them all, as vLLM's ``--chat-template`` does. None when
        there is none; a ChatTemplateError when named templates include neither a default nor ``tool_use``."""
        if files.problem is not None:
            raise ChatTemplateError(files.problem)
        if source is not None:
            names = dict(files.named, default=(files.source, files.origin)) if files.named and files.source \
                else files.named
            if source not in names:
                check_template_source(source, names)
            text, origin = names.get(source, (source, "the chat template given in place of the model's"))
            return cls._parsed(files, text, origin)
        tool_use = cls._parsed(files, *files.named[TOOL_USE]) if TOOL_USE in files.named else None
        if files.source is None and tool_use is None:
            if files.named:
                raise ChatTemplateError(_no_default(files.named))
            return None
        return cls._parsed(files, files.source, files.origin, tool_use)

    @classmethod
    def _parsed(cls, files: ChatTemplateFiles, source: str | None, origin: str,
                tool_use: ChatTemplate | None = None) -> ChatTemplate:
        try:
            return cls(source, files.special_tokens, tool_use)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{files.directory}: the chat template does not parse ({exc}): fix "
                                    f"{origin}") from None

    def for_tools(self, tools: Sequence[object] | None) -> ChatTemplate:
        """The template that renders a request with ``tools`` (None: one without), picked as transformers'
        ``get_chat_template`` and vLLM pick it: ``tool_use`` where tools are given and the model has it, else the
        default (a ChatTemplateError where the model has none)."""
        if tools is not None and self.tool_use is not None:
            return self.tool_use
        if self._template is None:
            raise ChatTemplateError(_no_default())
        return self

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, variables: dict[str, Any] | None = None,
               continue_final_message: bool = False) -> str:
        """The prompt text for `messages` ({"role", "content"} dicts, with "tool_calls" and "tool_call_id" where
        they have them; content a string or text parts, put as the template takes it) and `tools` (OpenAI tool
        objects, as transformers' ``apply_chat_template`` takes them), with the template's own further
        ``variables`` (``enable_thinking``, ``documents``, say); ChatTemplateError when the template refuses them,
        ReservedVariableError when a variable would replace one of those it is given. With
        ``continue_final_message`` the text ends right after the final message's content, which the completion
        continues (UncontinuableMessageError when the template does not write it verbatim). The template is the
        one ``for_tools`` picks for ``tools``."""
        if (template := self.for_tools(tools)) is not self:
            return template.render(messages, add_generation_prompt, tools, variables, continue_final_message)
        messages = [_in_format(message, self.content_format) for message in messages]
        if continue_final_message:
            messages = [*messages[:-1], _tagged(messages[-1])]
        given = {"messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools,
                 **self.special_tokens}
        if taken := sorted(set(variables or {}) & set(given)):
            raise ReservedVariableError(f"chat_template_kwargs may not set {', '.join(taken)}: they come from the "
                                        f"request's own fields")
        try:
            text = self._template.render(**given, **{"documents": None, **(variables or {})})
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template is code: whatever it raises ({{ 1 / 0 }}, range(10**9)) is its fault
            detail = exc if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: {exc}"
            raise ChatTemplateError(f"the model's chat template failed on these messages: {detail}") from None
        return _cut_at_tag(text) if continue_final_message else text

    def render_with_calls(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None, variables: dict[str, Any] | None = None,
                          continue_final_message: bool = False) -> tuple[str, int | None]:
        """``render``'s text, and the first message whose tool calls it leaves out (``dropped_tool_calls``). A
        history sent without tools (a last turn with tools off) whose calls the default template leaves out
        (Hermes') renders through the model's ``tool_use`` template instead, with no tools, where it has one
        (transformers and vLLM render it through the default, dropping the calls silently)."""
        text = self.render(messages, add_generation_prompt, tools, variables, continue_final_message)
        dropped = self.dropped_tool_calls(messages, text, add_generation_prompt, tools, variables,
                                          continue_final_message)
        if dropped is None or tools is not None or self.tool_use is None:
            return text, dropped
        try:
            with_calls = self.tool_use.render(messages, add_generation_prompt, [], variables, continue_final_message)
        except ChatTemplateError:  # it takes no such history either: the calls the default leaves out are named
            return text, dropped
        return with_calls, self.tool_use.dropped_tool_calls(messages, with_calls, add_generation_prompt, [],
                                                            variables, continue_final_message)

    def dropped_tool_calls(self, messages: list[dict[str, Any]], text: str, add_generation_prompt: bool = True,
                           tools: list[dict] | None = None, variables: dict[str, Any] | None = None,
                           continue_final_message: bool = False) -> int | None:
        """The index of the first of ``messages`` (rendered as ``text`` by ``render`` with these arguments) whose
        ``tool_calls`` the template leaves out of the prompt: it renders them the same without their calls (a
        template that refuses the messages without them renders them); None where none is left out. The calls of a
        continued final message are cut off with what follows its content, rendered or not."""
        called = [i for i, m in enumerate(messages[:-1] if continue_final_message else messages) if "tool_calls" in m]
        if not called:
            return None
        without = [{key: value for key, value in m.items() if key != "tool_calls"} for m in messages]
        try:
            same = self.render(without, add_generation_prompt, tools, variables, continue_final_message) == text
        except ChatTemplateError:
            return None
        return called[0] if same else None


def check_template_source(source: str, names: Mapping[str, object] | None = None) -> None:
    """Refuse a ``source`` given as a template that holds no Jinja block (no ``{{ }}`` or ``{% %}``): a misspelt
    name of one of the engine's templates (``names``) or a file's path, which would render as itself and drop every
    message."""
    if "{{" not in source and "{%" not in source:
        known = f"this engine's named templates are {', '.join(names)}" if names else "this engine names none"
        raise ChatTemplateError(f"chat_template {source!r} is no template (it holds no {{{{ ... }}}} or {{% ... %}}) "
                                f"and no template's name ({known}); pass the template's text (a file's: "
                                f"Path(FILE).read_text())")


def _no_default(names: Iterable[str] = ()) -> str:
    named = f" ({', '.join(sorted(names))})" if names else ""
    return (f"none of the model's named chat templates{named} is named 'default', which renders messages without "
            f"tools (transformers refuses them too): send tools, or give a chat template in its place")


# what transformers' continue_final_message appends to the final message's text, to cut the rendered text there
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with ``CONTINUE_TAG`` after its text (its last text part's, as transformers tags it)."""
    content = message.get("content") or ""
    if isinstance(content, str):
        return {**message, "content": content + CONTINUE_TAG}
    parts = list(content)
    last = next((i for i in reversed(range(len(parts))) if "text" in parts[i]), None)
    if last is None:  # no text to continue (an empty message of a parts-only template): an empty part, tagged
        return {**message, "content": [*parts, {"type": "text", "text": CONTINUE_TAG}]}
    parts[last] = {**parts[last], "text": parts[last]["text"] + CONTINUE_TAG}
    return {**message, "content": parts}


def _cut_at_tag(text: str) -> str:
    """``text`` up to the tag ``_tagged`` put after the final message's text, as transformers'
    ``continue_final_message`` cuts it (less the trailing spaces where the template stripped the message)."""
    at = text.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise UncontinuableMessageError("the chat template does not render the final message verbatim, so it cannot "
                                        "be continued: send add_generation_prompt false without "
                                        "continue_final_message")
    return text[:at] if text.startswith(CONTINUE_TAG, at) else text[:at].rstrip()


# content part types read as text (the Responses API's input_text and output_text too, as vLLM reads them), each
# to the key that holds its text
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def message_content(content: Any) -> str | list[dict[str, str]]:
    """A message's content as chat templates take it: a string (None as empty), or a list of text parts, each as
    ``{"type": "text", "text": ...}`` (an assistant's refusal parts taken as its text); ValueError for anything else
    (images and audio included)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
            if key is None or not isinstance(part.get(key), str):
                raise ValueError("parts must be {'type': 'text', 'text': str} ('input_text' or 'output_text' too, or "
                                 "an assistant's {'type': 'refusal', 'refusal': str}): only text content is supported")
            parts.append({"type": "text", "text": part[key]})
        return parts
    raise ValueError("must be a string or a list of text parts")


def message_text(content: Any) -> str:
    """A message's content as one text: its text parts joined by newlines, as vLLM joins them for a template that
    takes strings (``message_content``'s errors)."""
    content = message_content(content)
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as chat templates take it (transformers' convention): text content (an assistant's
    refusal as what it said), OpenAI's ``developer`` role as ``system``, which templates know, a tool call's
    arguments as an object, and earlier reasoning by both its names, as vLLM passes it. Its ``role`` and
    ``tool_calls`` are taken as checked."""
    role = message["role"]
    result = {"role": "system" if role == "developer" else role,
              "content": message_content(message.get("content")) or message.get("refusal") or ""}
    for key in ("name", "tool_call_id"):
        if message.get(key):
            result[key] = message[key]
    if calls := message.get("tool_calls"):
        result["tool_calls"] = [{"id": call.get("id"), "type": "function", "function": {
            "name": call["function"]["name"], "arguments": _arguments(call["function"].get("arguments", {}))}}
            for call in calls]
    if reasoning := message.get("reasoning_content") or message.get("reasoning"):
        result["reasoning"] = result["reasoning_content"] = reasoning
    return result


def _arguments(arguments: Any) -> dict:
    """A tool call's arguments as chat templates take them (transformers' convention): the JSON object the OpenAI
    string holds; {} for one that holds none (empty, cut off by a length limit, an array, nested deeper or with
    longer numbers than Python reads), as vLLM passes it, so that a template that iterates the arguments still renders
    the history (a warning names what was replaced)."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):  # not JSON, an integer past Python's 4,300 digits, or nested too deeply
        value = None
    if isinstance(value, dict):
        return value
    if arguments not in ("", None):  # the arguments themselves are the user's: not logged
        logger.warning("a tool call's arguments in the messages are no JSON object (%d characters): the chat "
                       "template gets {} in their place, as vLLM passes them", len(str(arguments)))
    return {}
