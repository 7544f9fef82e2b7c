"""Tool calls as chat templates write them: the format a model was trained to call tools in, read from its chat
template, with the grammar that forces a call (``tool_choice`` "required" or a named function) and the parser that
finds calls in a completion.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call (Hermes, Qwen2 /
  2.5 / 3 templates).
- ``llama3_json``: the whole completion is ``{"name": ..., "parameters": {...}}`` (Llama 3.1 / 3.2 / 3.3 templates,
  which also let the model open with ``<|python_tag|>``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from kiln.runtime.structured_output import closed_objects


@dataclass(frozen=True)
class ToolCall:
    """One call: a function name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ToolCallFormat:
    """How one template family writes calls: ``open`` / ``close`` around each call's JSON (empty for a bare JSON
    completion), and the key that holds the arguments."""

    name: str
    open: str
    close: str
    arguments_key: str

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) whose strings are calls of ``tools`` (OpenAI function objects),
        one, or several when ``parallel`` and the format can hold several."""
        alternatives = [{"type": "object",
                         "properties": {"name": {"const": tool["name"]},
                                        self.arguments_key: tool.get("parameters") or {"type": "object"}},
                         "required": ["name", self.arguments_key], "additionalProperties": False} for tool in tools]
        schema = json.dumps(closed_objects({"anyOf": alternatives}))  # arguments hold the keys their schema names
        call = f"{json.dumps(self.open)} %json {schema} {json.dumps(self.close)}" if self.open else f"%json {schema}"
        repeat = '("\\n" call)*' if parallel and self.open else ""
        return f"start: call {repeat}\ncall: {call}\n"

    def content_before_calls(self, text: str) -> int:
        """How much of a completion's ``text`` so far is surely content, not the start of a call: what a stream may
        send before the completion ends."""
        if not self.open:  # a bare JSON call is the whole completion: hold anything that may open one
            stripped = text.lstrip()
            return 0 if not stripped or stripped.startswith(("{", "<|python_tag|>")) else len(text)
        marker = self.open.strip()
        if (index := text.find(marker)) >= 0:
            return index
        for keep in range(min(len(marker) - 1, len(text)), 0, -1):  # a tail that may begin the marker
            if marker.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content before the first call, and the calls; no calls (and the whole text as content) when the
        completion holds none that parse."""
        if not self.open:
            body = text.strip().removeprefix("<|python_tag|>").strip()
            calls = [self._call(part) for part in body.split(";")] if body.startswith("{") else []
            return ("", calls) if calls and all(calls) else (text, [])
        marker = self.open.strip()
        pattern = re.escape(marker) + r"\s*(.*?)\s*" + re.escape(self.close.strip())
        calls = [self._call(block) for block in re.findall(pattern, text, flags=re.DOTALL)]
        if not calls or not all(calls):
            return text, []
        return text[:text.find(marker)].rstrip(), calls

    def _call(self, source: str) -> ToolCall | None:
        try:
            value = json.loads(source)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(self.arguments_key, value.get("arguments", {}))
        return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


HERMES = ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments")
LLAMA3_JSON = ToolCallFormat("llama3_json", "", "", "parameters")


def tool_call_format(template_source: str) -> ToolCallFormat | None:
    """The format a chat template teaches its model to call tools in; None when it renders no tools."""
    if "tools" not in template_source:
        return None
    if "<tool_call>" in template_source:
        return HERMES
    if "<|python_tag|>" in template_source or '"parameters"' in template_source:
        return LLAMA3_JSON
    return None
