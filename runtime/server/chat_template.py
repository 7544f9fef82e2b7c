"""The checkpoint's own chat template, rendered the way Hugging Face tokenizers render it (sandboxed Jinja)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.runtime.errors import KilnError
from kiln.runtime.tokenizer import special_token_text

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(KilnError):
    """Messages the template refuses (it raised), or a template that does not render."""


class ReservedVariableError(ChatTemplateError):
    """A further template variable that would replace one the server sets (messages, tools, bos_token, ...)."""


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


class ChatTemplate:
    """Turns OpenAI chat messages into the prompt text the model was trained on."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self._template = _environment().from_string(source)
        self.source = source
        self.special_tokens = special_tokens

    @classmethod
    def from_dir(cls, directory: Path, source: str | None = None) -> ChatTemplate | None:
        """The template of an engine or checkpoint directory (`chat_template.jinja`, else `tokenizer_config.json`'s
        `chat_template`), or ``source`` in its place (with the directory's special tokens); None when it has
        none."""
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        jinja_path = directory / "chat_template.jinja"
        if source is not None:
            origin = "the chat template given to the server"
        else:
            origin = jinja_path.name if jinja_path.is_file() else "chat_template in tokenizer_config.json"
            source = jinja_path.read_text() if jinja_path.is_file() else config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        special = {name: text for name in _SPECIAL_TOKENS if (text := special_token_text(config.get(name)))}
        try:
            return cls(source, special)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{directory}: the chat template does not parse ({exc}): fix {origin}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, variables: dict[str, Any] | None = None) -> str:
        """The prompt text for `messages` ({"role", "content"} dicts, with "tool_calls" and "tool_call_id" where
        they have them) and `tools` (OpenAI tool objects, as transformers' ``apply_chat_template`` takes them), with
        the template's own further ``variables`` (``enable_thinking``, say); ChatTemplateError when the template
        refuses them, ReservedVariableError when a variable would replace one of those it is given."""
        given = {"messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools,
                 "documents": None, **self.special_tokens}
        if taken := sorted(set(variables or {}) & set(given)):
            raise ReservedVariableError(f"chat_template_kwargs may not set {', '.join(taken)}: the server sets them")
        try:
            return self._template.render(**given, **(variables or {}))
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:
            raise ChatTemplateError(f"the model's chat template failed on these messages: {exc}") from None
