"""Tool calls as chat templates write them: the format a model was trained to call tools in, read from its chat
template, with the grammar that forces a call (``tool_choice`` "required" or a named function) and the parser that
finds calls in a completion.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call (Hermes, Qwen2 /
  2.5 / 3 templates).
- ``llama3_json``: the whole completion is ``{"name": ..., "parameters": {...}}``, or several such objects separated
  by ";" (Llama 3.1 / 3.2 / 3.3 templates, which also let the model open with ``<|python_tag|>``).
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` ends the completion, after any content
  (Mistral v0.3, Nemo and Small templates; ``[TOOL_CALLS]`` is a special token, so the text usually holds the array
  alone), with call ids of 9 letters and digits, which those templates require of the calls passed back.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from urllib.parse import unquote

from kiln.runtime.server.partial_tags import partial_tag_length
from kiln.runtime.structured_output import (
    DEFINITION_KEYS,
    escaped_token,
    in_fragment,
    json_rule,
    pointer_refs,
    pointer_token,
    with_subschemas,
)

_NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: a function without parameters takes none
_SEPARATOR = re.compile(r"\s*;\s*")  # between the calls of a Llama 3 JSON completion
_COMMA = re.compile(r"\s*,\s*")  # between the calls of a Mistral array
# what opens a Mistral array of calls: its first object's "name" key (not any JSON array: '[{"a": 1}] says'), and
# what may open one at the very end of a text so far ("[", '[{"na', ...)
_CALLS_ARRAY = re.compile(r'\[\s*\{\s*"name"')
_CALLS_ARRAY_BEGUN = re.compile(r'\[\s*(?:\{\s*(?:"(?:n(?:a(?:m(?:e)?)?)?)?)?)?\Z')
# a call's JSON cut off after its name: the name, and the arguments as far as they got
_CUT_OFF_CALL = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
                           r"(?P<arguments>.*)", re.DOTALL)


def openai_call_id() -> str:
    """A call id as OpenAI writes them."""
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """A call id as Mistral's templates require: 9 letters and digits."""
    return uuid.uuid4().hex[:9]


@dataclass(frozen=True)
class ToolCall:
    """One call: a function name, its arguments as JSON text (OpenAI's shape) and its id; ``cut_off`` when the
    token limit ended it part way (its arguments as far as they got)."""

    name: str
    arguments: str
    id: str
    cut_off: bool = False


@dataclass(frozen=True)
class ToolCallFormat:
    """How one template family writes calls: ``open`` / ``close`` around each call's JSON, or, for a completion of
    calls alone (``open`` empty), the ``prefix`` the model may open it with and whether the calls are one JSON array
    (``listed``) or objects separated by ";"; the key that holds the arguments, and how a call's id is made."""

    name: str
    open: str
    close: str
    arguments_key: str
    prefix: str = ""
    listed: bool = False
    prefix_kept: bool = False  # a prefix that is a special token stays in the text, for calls after content
    new_id: Callable[[], str] = openai_call_id

    def grammar(self, tools: list[dict], parallel: bool, answer: str | None = None) -> str:
        """A Lark grammar (llguidance's dialect) whose strings are calls of ``tools`` (OpenAI function objects),
        one, or several when ``parallel`` and the format can hold several; their JSON is compact and their arguments
        hold the keys their schema names (``json_rule``). With ``answer`` (a Lark rule's body: ``response_format``'s
        JSON under ``tool_choice`` auto), its strings are those calls or that answer."""
        definitions: dict = {}  # every tool's $defs / definitions, moved to the root where its "#/..." refs point
        alternatives = [{"type": "object",
                         "properties": {"name": {"const": tool["name"]},
                                        self.arguments_key: _hoisted(tool.get("parameters") or _NO_PARAMETERS,
                                                                     f"tool{index}", definitions)},
                         "required": ["name", self.arguments_key], "additionalProperties": False}
                        for index, tool in enumerate(tools)]  # by place: a name may hold what a JSON pointer cannot
        call = json_rule({"anyOf": alternatives, **({"$defs": definitions} if definitions else {})})
        if self.open:
            call = f"{json.dumps(self.open)} {call} {json.dumps(self.close)}"
        if self.listed:
            calls = '"[" call ("," call)* "]"' if parallel else '"[" call "]"'
        else:
            calls = 'call ("\\n" call)*' if parallel and self.open else "call"
        start = f"start: {calls}\n" if answer is None else f"start: answer | {calls}\nanswer: {answer}\n"
        return f"{start}call: {call}\n"

    def content_before_calls(self, text: str) -> int:
        """How much of a completion's ``text`` so far is surely content: not the start of a call, nor the whitespace
        before one (which ``parse`` strips); what a stream may send before the completion ends."""
        return len(text[:self._call_start(text)].rstrip())

    def _call_start(self, text: str) -> int:
        """Where a call may begin in ``text`` so far (its length when none can)."""
        if self.listed:  # the prefix marker, else an array of calls, or what may begin either at the end
            if (index := text.find(self.prefix)) >= 0:
                return index
            opened = _CALLS_ARRAY.search(text) or _CALLS_ARRAY_BEGUN.search(text)
            return min(opened.start() if opened else len(text), len(text) - partial_tag_length(text, self.prefix))
        if not self.open:  # a completion of calls alone: hold anything that may open one
            stripped = text.lstrip()
            if not stripped or (self.prefix and (stripped.startswith(self.prefix) or self.prefix.startswith(stripped))):
                return 0
            return 0 if stripped.startswith("{") else len(text)
        marker = self.open.strip()
        if (index := text.find(marker)) >= 0:
            return index
        return len(text) - partial_tag_length(text, marker)  # a tail that may begin the marker is held

    def parse(self, text: str, functions: Collection[str]) -> tuple[str, list[ToolCall]]:
        """The content before the first call, and the whole calls (a call cut off after them is left out); no calls
        (and the whole text as content) unless every whole call parses and names one of ``functions``."""
        start = 0  # where the calls begin: the content is the text before them
        if self.listed:
            start, values, _ = self._listed(text) or (0, [], "")
            calls = [self._call(value, functions) for value in values]
        elif not self.open:  # one or more JSON objects, separated by ";"
            body = self._body(text)
            values = _json_values(body) if body.startswith("{") else None
            calls = [self._call(value, functions) for value in values or []]
        else:
            marker = self.open.strip()
            start = text.find(marker)
            pattern = re.escape(marker) + r"\s*(.*?)\s*" + re.escape(self.close.strip())
            calls = [self._call(_json_value(block), functions) for block in re.findall(pattern, text, flags=re.DOTALL)]
            if (tail := self._unclosed(text)) is not None and (last := self._call(_json_value(tail), functions)):
                calls.append(last)  # whole, but its closing marker never came (a stop string, or the end)
        if not calls or not all(calls):
            return text, []
        return text[:start].rstrip(), calls

    def cut_off_call(self, text: str, functions: Collection[str]) -> ToolCall | None:
        """The call a completion of calls alone (a forced call) ended inside, cut off by its token limit: its
        arguments as far as they got, as OpenAI returns a call cut off by ``length``; None when the completion ends
        with a whole call, or before the call's name is whole."""
        if self.listed:
            tail = listed[2] if (listed := self._listed(text)) else ""
        elif self.open:
            tail = self._unclosed(text) or ""
        else:
            tail = self._body(text)
            if _json_values(tail) is not None:
                return None
        if self._call(_json_value(tail), functions) is not None:  # whole: parse has it
            return None
        match = _CUT_OFF_CALL.match(tail)
        if match is None or match["name"] not in functions:
            return None
        return ToolCall(match["name"], match["arguments"], self.new_id(), cut_off=True)

    def unfinished_call(self, text: str, functions: Collection[str]) -> str:
        """The text of the call a completion of calls alone (a forced call) ended inside, from where that call opens:
        all of ``text`` when it holds no whole call, "" when it ends with whole calls (or a marker cut off part
        way after them)."""
        if not self.parse(text, functions)[1]:
            return text
        if self.listed:
            return self._listed(text)[2]
        tail = self._unclosed(text) if self.open else None
        if tail is not None and self._call(_json_value(tail), functions) is None:
            return text[text.rfind(self.open.strip()):]
        return ""

    def _body(self, text: str) -> str:
        """A completion of calls alone without the whitespace around it and the prefix it may open with."""
        body = text.strip()
        return body.removeprefix(self.prefix).strip() if self.prefix else body

    def _unclosed(self, text: str) -> str | None:
        """The text after the last ``open`` marker when no ``close`` follows it (a closing marker cut off part way
        left out); None when every call is closed."""
        marker, close = self.open.strip(), self.close.strip()
        start = text.rfind(marker)
        if start < 0 or close in text[start:]:
            return None
        return _without_partial_suffix(text[start + len(marker):].strip(), close)

    def _listed(self, text: str) -> tuple[int, list[object], str] | None:
        """Where a listed completion's calls begin (at its prefix marker where the text holds it, as vLLM splits
        there, text after the closed array left out, as after the last of ``open`` / ``close``'s calls; else at the
        first array of calls, opened by its first object's "name", that runs to the end, the marker being a special
        token left out of the text), their whole values and the start of a value cut off after them ("" when there is
        none); None when no such array runs to the end (or, after the marker, is closed)."""
        marker = text.find(self.prefix)
        for start in [marker] if marker >= 0 else [match.start() for match in _CALLS_ARRAY.finditer(text)]:
            body = self._body(text[start:])
            if not body.startswith("["):
                continue
            values, rest = _leading_values(body[1:].lstrip(), _COMMA)
            rest = rest.removeprefix(",").strip()
            # closed (behind the marker, any text after it dropped), or ended (a stop string) before the bracket
            if rest in ("", "]") or (marker >= 0 and rest.startswith("]")):
                return start, values, ""
            if rest.startswith("{"):
                return start, values, rest
        return None

    def _call(self, value: object, functions: Collection[str]) -> ToolCall | None:
        """``value`` as a call: an object whose "name" is one of ``functions`` and whose arguments (an object, or
        its JSON text) are under the format's key or "arguments"; None when it is not one."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in functions:
            return None
        arguments = next((value[key] for key in (self.arguments_key, "arguments") if key in value), None)
        if not isinstance(arguments, dict | str):
            return None
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)  # as OpenAI
        return ToolCall(value["name"], text, self.new_id())


def _hoisted(parameters: dict, tool: str, definitions: dict) -> dict:
    """A tool's ``parameters`` as a subschema of the call's schema: its ``$defs`` / ``definitions`` (and itself, when
    a ``"#"`` ref recurses to it) added to ``definitions`` under names unique to the tool (``tool``, a JSON pointer's
    segment), and its local refs
    rewritten to point there (a ref is resolved against the root of the whole schema, not of the parameters; one
    through a ``$id`` or ``$anchor`` is made a local one first, ``pointer_refs``)."""
    parameters = pointer_refs(parameters)
    own = {f"#/{key}/{escaped_token(name)}": (f"{tool}__{name}", sub) for key in DEFINITION_KEYS
           if isinstance(parameters.get(key), dict) for name, sub in parameters[key].items()}
    # each local pointer, percent-decoded ("#/$defs/X", "#/definitions/X", "#" itself) -> its new one, the longest
    # matched first
    names = {**{ref: f"#/$defs/{pointer_token(name)}" for ref, (name, _) in own.items()},
             "#": f"#/$defs/{tool}__root"}
    bases = sorted(names, key=len, reverse=True)
    recursive = False  # a ref to the parameters themselves: they become a definition too

    def rewrite(node: object) -> object:
        nonlocal recursive
        if not isinstance(node, dict):
            return node
        out = with_subschemas(node, rewrite)  # names and data (a const's "$ref" key) kept
        if isinstance(ref := out.get("$ref"), str) and ref.startswith("#"):
            decoded = unquote(ref)  # "#/$defs/A%20B" names "A B"
            base = next((b for b in bases if decoded == b or decoded.startswith(b + "/")), None)
            if base is not None:
                out["$ref"] = names[base] + in_fragment(decoded[len(base):])
                recursive = recursive or base == "#"
        return out

    for name, sub in own.values():
        definitions[name] = rewrite(sub)
    body = rewrite({key: value for key, value in parameters.items() if key not in DEFINITION_KEYS})
    if recursive:
        definitions[f"{tool}__root"] = body
    return body


def _json_value(text: str) -> object | None:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # no JSON, an integer past Python's 4,300 digits, or nested too deeply
        return None


def _without_partial_suffix(text: str, close: str) -> str:
    """``text`` without a trailing start of ``close`` (a call cut off inside its closing marker)."""
    keep = partial_tag_length(text, close)
    return text[:len(text) - keep].rstrip() if keep else text


def _leading_values(text: str, separator: re.Pattern) -> tuple[list[object], str]:
    """The JSON values at the start of ``text``, one after another with ``separator`` between them, and the text
    after the last of them (stripped)."""
    decoder, values, index, end = json.JSONDecoder(), [], 0, 0
    while True:
        try:
            value, end = decoder.raw_decode(text, index)
        except (ValueError, RecursionError):  # no JSON, an integer past Python's 4,300 digits, or nested too deeply
            return values, text[end:].strip()
        values.append(value)
        if (between := separator.match(text, end)) is None or between.end() == len(text):
            return values, text[end:].strip()
        index = between.end()


def _json_values(text: str) -> list[object] | None:
    """The JSON values ``text`` holds one after another, separated by ";"; None when it holds anything else."""
    values, rest = _leading_values(text, _SEPARATOR)
    return values if values and not rest else None


HERMES = ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments")
LLAMA3_JSON = ToolCallFormat("llama3_json", "", "", "parameters", prefix="<|python_tag|>")
MISTRAL = ToolCallFormat("mistral", "", "", "arguments", prefix="[TOOL_CALLS]", listed=True, prefix_kept=True,
                         new_id=mistral_call_id)  # vLLM's mistral parser keeps [TOOL_CALLS] too


def tool_call_format(template_source: str) -> ToolCallFormat | None:
    """The format a chat template teaches its model to call tools in; None when it renders no tools."""
    if "tools" not in template_source:
        return None
    if "<tool_call>" in template_source:
        return HERMES
    if "[TOOL_CALLS]" in template_source:  # before Llama's test: Mistral's templates write "parameters" too
        return MISTRAL
    if "<|python_tag|>" in template_source or '"parameters"' in template_source:
        return LLAMA3_JSON
    return None
