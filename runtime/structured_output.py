"""Structured output: a completion held to a JSON schema, any JSON object, a regular expression, a grammar or one of
a list of strings, by masking every token that would leave the format (llguidance compiles the format against the
tokenizer and computes each step's mask: ``runtime/native/grammar.py``).

``StructuredOutput`` says what a request wants (``SamplingParams.structured_output``); its llguidance grammar is
compiled and checked when the parameters are made, so a bad schema or regex is refused before the request runs.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import quote, unquote, urldefrag, urljoin

from kiln.runtime.errors import InvalidRequestError

# JSON without optional whitespace: a model that may emit whitespace between tokens can pad forever.
_JSON_OPTIONS = {"whitespace_flexible": False}
# Keywords whose value is one subschema, a list of them, or a mapping of names to them (JSON Schema 2020-12).
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "not", "if",
              "then", "else", "additionalItems", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
DEFINITION_KEYS = ("$defs", "definitions")  # where a schema keeps the subschemas its local $refs name
_SUBSCHEMA_MAPS = ("properties", *DEFINITION_KEYS, "patternProperties", "dependentSchemas")
# Keywords whose value is data (an instance, or a list of them), never a schema: a "$ref", "$id" or "$anchor" key in
# it is a key of that data, which a walk over the schema's subschemas leaves alone
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
MAX_FORMAT_CHARS = 128 * 1024  # of a schema, regex, grammar or the choices together
MAX_SCHEMA_DEPTH = 120  # levels of objects and lists in a JSON schema: llguidance parses about 124
# local $refs followed one inside another, and rules in a Lark grammar: llguidance 1.9 compiles them recursively and
# overflows an 8 MiB stack, killing the process, from about 700 chained refs and 3,000 chained rules
MAX_REF_CHAIN = 128
MAX_GRAMMAR_RULES = 1000
# llguidance takes a schema's integers as i64 or u64 (any other raised a bare ValueError) and crashes the process on
# an integer const or bound that rounds to -2**63 as a float (1.9: a segfault)
INTEGER_RANGE = range(-2**63 + 513, 2**64)
_GRAMMAR_RULE = re.compile(r"^\s*[?!]?[A-Za-z_]\w*(?:\.-?\d+)?\s*:", re.MULTILINE)
_JSON_DIRECTIVE = re.compile(r"%json\s*")
_UNKNOWN_FORMAT = "Unknown format:"
# a GBNF \u escape (4 hex digits) or \U escape (8), or an escaped backslash (so that "\\u00e9" stays a backslash
# and "u00e9")
_GBNF_ESCAPE = re.compile(r"\\(?:\\|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8}))")


class StructuredOutputError(InvalidRequestError):
    """A format that cannot be compiled (a schema llguidance does not support, a bad regex or grammar)."""


class FormatTooLargeError(StructuredOutputError):
    """A format longer than ``MAX_FORMAT_CHARS``, refused before it is compiled."""


_OUT_OF_RANGE = "{} holds {}, outside the integers the grammar engine takes (-2**63 + 513 to 2**64 - 1)"
_TOO_DEEP = f"the JSON schema is nested too deeply: at most {MAX_SCHEMA_DEPTH} levels of objects and lists are taken"


def _nesting_exceeds(value: object, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) holds objects and lists more than ``limit`` levels deep, walked without
    recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in children)
    return False


def _longest_ref_chain(schema: dict) -> int:
    """The most local ``$ref``s followed one inside another from ``schema`` (a ref back to one being followed, a
    recursion, ends its chain), walked without recursion."""
    def within(node: object) -> list[str]:
        found, stack = [], [node]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                if isinstance(ref := item.get("$ref"), str) and ref.startswith("#"):
                    found.append(ref)
                stack.extend(sub for _, sub in subschemas(item))
            elif isinstance(item, list):  # a ref to a list of subschemas (#/anyOf)
                stack.extend(item)
        return list(dict.fromkeys(found))

    depth: dict[str, int] = {}
    path, stack = {"#"}, [("#", iter(within(schema)), 0)]
    while stack:
        ref, rest, best = stack[-1]
        child = next(rest, None)
        if child is None:
            stack.pop()
            path.discard(ref)
            depth[ref] = best + 1
            if stack:
                parent, siblings, parent_best = stack[-1]
                stack[-1] = (parent, siblings, max(parent_best, depth[ref]))
        elif child in depth:
            stack[-1] = (ref, rest, max(best, depth[child]))
        elif child not in path:
            path.add(child)
            stack.append((child, iter(within(_pointed(schema, child))), 0))
    return depth["#"] - 1


def _pointed(schema: dict, ref: str) -> Any:
    """What a local ``ref`` (a JSON pointer from ``schema``'s root, percent-encoded or not) points at in ``schema``;
    None where it points at nothing, or is no such pointer."""
    pointer = unquote(ref[1:]) if ref.startswith("#") else None
    if pointer is None or (pointer and not pointer.startswith("/")):
        return None
    node: Any = schema
    for token in pointer.split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(token)
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def subschemas(schema: dict) -> Iterator[tuple[str, object]]:
    """Each value directly under ``schema``'s keywords that may be a subschema, with its JSON pointer from
    ``schema`` (``/properties/a``, ``/anyOf/0``): a mapping of names to subschemas (``properties``, ``$defs``, ...)
    gives its values, whose keys are names, not keywords; a list its items; ``DATA_KEYWORDS`` nothing."""
    def within(value: object, pointer: str) -> Iterator[tuple[str, object]]:
        if isinstance(value, list):
            for index, item in enumerate(value):
                yield from within(item, f"{pointer}/{index}")
        else:
            yield pointer, value

    for key, value in schema.items():
        if key in DATA_KEYWORDS:
            continue
        pointer = f"/{pointer_token(key)}"
        if _maps_names(key, value):
            yield from ((f"{pointer}/{pointer_token(name)}", sub) for name, sub in value.items())
        else:
            yield from within(value, pointer)


def with_subschemas(schema: dict, change: Callable[[object], object]) -> dict:
    """``schema`` with each value ``subschemas`` gives replaced by ``change(value)``, the rest (names, data) kept."""
    def within(value: object) -> object:
        return [within(item) for item in value] if isinstance(value, list) else change(value)

    return {key: value if key in DATA_KEYWORDS
            else {name: change(sub) for name, sub in value.items()} if _maps_names(key, value) else within(value)
            for key, value in schema.items()}


def _maps_names(key: str, value: object) -> bool:
    """Whether ``value``, under a schema's ``key``, maps names to subschemas (its keys are names, not keywords)."""
    return key in _SUBSCHEMA_MAPS and isinstance(value, dict)


def _check_schema(schema: object, what: str) -> None:
    """Refuse a JSON schema (``what`` names it) nested deeper, or following more $refs one inside another, than
    llguidance compiles without overflowing its stack, or holding an integer it does not take."""
    if _nesting_exceeds(schema, MAX_SCHEMA_DEPTH):
        raise StructuredOutputError(_TOO_DEEP)
    if (number := _integer_out_of_range(schema)) is not None:
        shown = f"the number {number}" if number.bit_length() <= 256 else "an integer of more than 77 digits"
        raise StructuredOutputError(_OUT_OF_RANGE.format(what, shown))
    if isinstance(schema, dict) and (chain := _longest_ref_chain(pointer_refs(schema))) > MAX_REF_CHAIN:
        raise StructuredOutputError(f"{what} follows {chain} $refs one inside another; at most {MAX_REF_CHAIN} are "
                                    f"taken")


def pointer_refs(schema: dict) -> dict:
    """``schema`` with each ``$ref`` to a place inside it written as a JSON pointer from its root (``#/$defs/x``),
    however it names that place: through a ``$id`` (the root's, ``https://example.com/args.json#/$defs/x``, or a
    subschema's, resolved against the base URI where the ref stands) or an ``$anchor``; its ``$id``s and
    ``$anchor``s dropped, and a ref to anything else made absolute, so that the schema means the same under another
    (a tool's parameters in a call's schema). ``schema`` itself when it has no ``$id`` or ``$anchor``."""
    resources: dict[str, str] = {}  # a resource's URI -> the pointer to it
    anchors: dict[tuple[str, str], str] = {}  # (a resource's URI, an anchor's name) -> the pointer to it

    def collect(node: object, base: str, pointer: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$id"), str):
                base, fragment = urldefrag(_resolved(base, node["$id"]))
                resources.setdefault(base, pointer)
                if fragment:  # a draft-06 "$id": "#name" is an anchor
                    anchors.setdefault((base, fragment), pointer)
            if isinstance(node.get("$anchor"), str):
                anchors.setdefault((base, node["$anchor"]), pointer)
            for suffix, sub in subschemas(node):
                collect(sub, base, pointer + suffix)

    def rewrite(node: object, base: str) -> object:
        if not isinstance(node, dict):
            return node
        if isinstance(node.get("$id"), str):
            base = urldefrag(_resolved(base, node["$id"])).url
        out = {key: value for key, value in with_subschemas(node, lambda sub: rewrite(sub, base)).items()
               if not (key in ("$id", "$anchor") and isinstance(value, str))}
        if isinstance(ref := out.get("$ref"), str):
            uri, fragment = urldefrag(_resolved(base, ref))
            if uri not in resources:
                out["$ref"] = _resolved(base, ref)
            elif not fragment or fragment.startswith("/"):
                out["$ref"] = f"#{resources[uri]}{fragment}"
            else:  # an anchor, or a name no anchor has (the grammar engine names it)
                out["$ref"] = f"#{anchors.get((uri, fragment), fragment)}"
        return out

    root = urldefrag(_resolved("", schema["$id"])).url if isinstance(schema.get("$id"), str) else ""
    resources[root] = ""
    collect(schema, root, "")
    return schema if len(resources) == 1 and not anchors and "$id" not in schema else rewrite(schema, root)


def _resolved(base: str, ref: str) -> str:
    """``ref`` resolved against ``base`` (a fragment alone against any base, ``urn:`` ones too)."""
    return urldefrag(base).url + ref if ref.startswith("#") else urljoin(base, ref)


def pointer_token(key: str) -> str:
    """``key`` as one token of a JSON pointer in a URI fragment."""
    return in_fragment(escaped_token(key))


def escaped_token(key: str) -> str:
    """``key`` as one token of a JSON pointer (RFC 6901: "~" and "/" escaped), not yet percent-encoded."""
    return key.replace("~", "~0").replace("/", "~1")


def in_fragment(pointer: str) -> str:
    """A JSON pointer percent-encoded as a URI fragment writes it (``/$defs/A B`` -> ``/$defs/A%20B``)."""
    return quote(pointer, safe="/!$&'()*+,;=:@~")


def _integer_out_of_range(schema: object) -> int | None:
    """The first integer in ``schema`` (parsed JSON) outside ``INTEGER_RANGE``, walked without recursion."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict | list):
            stack.extend(item.values() if isinstance(item, dict) else item)
        elif isinstance(item, int) and item not in INTEGER_RANGE:
            return item
    return None


def _embedded_schemas(grammar: str) -> list[object]:
    """The JSON schemas a Lark grammar embeds with llguidance's ``%json { ... }`` (text after a ``%json`` that is no
    JSON is left for llguidance to name)."""
    decoder, schemas = json.JSONDecoder(), []
    for directive in _JSON_DIRECTIVE.finditer(grammar):
        try:
            schemas.append(decoder.raw_decode(grammar, directive.end())[0])
        except ValueError:  # no JSON, or an integer of more digits than Python reads: llguidance names it
            continue
        except RecursionError:
            raise StructuredOutputError(_TOO_DEEP) from None
    return schemas


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON object),
    ``regex``, ``grammar`` (a Lark grammar in llguidance's dialect, which can embed JSON schemas with ``%json``) or
    ``choice`` (the completion is one of these strings)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        if self.json_object is None:  # vLLM's StructuredOutputsParams default, as its asdict() gives it
            object.__setattr__(self, "json_object", False)
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(f"structured output takes exactly one of json, json_object, regex, grammar "
                                        f"or choice, got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
            except ValueError:  # an integer of more digits than Python reads
                raise StructuredOutputError(_OUT_OF_RANGE.format("the JSON schema", "an integer of thousands of "
                                                                 "digits")) from None
            except RecursionError:
                raise StructuredOutputError(_TOO_DEEP) from None
        if self.json is not None and not isinstance(self.json, dict):
            raise StructuredOutputError(f"a JSON schema must be an object, got {type(self.json).__name__}")
        _check_schema(self.json, "the JSON schema")
        if not isinstance(self.json_object, bool):
            raise StructuredOutputError(f"json_object must be true or false, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            if (value := getattr(self, name)) is not None and not isinstance(value, str):
                raise StructuredOutputError(f"{name} must be a string, got {type(value).__name__}")
        if self.choice is not None and (not isinstance(self.choice, list | tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
        if self.grammar is not None and (rules := len(_GRAMMAR_RULE.findall(self.grammar))) > MAX_GRAMMAR_RULES:
            raise StructuredOutputError(f"the grammar has {rules:,} rules; at most {MAX_GRAMMAR_RULES:,} are taken")
        for schema in _embedded_schemas(self.grammar or ""):
            _check_schema(schema, "a %json schema of the grammar")
        source = self.regex or self.grammar or "".join(self.choice or ()) or json.dumps(self.json or {})
        if len(source) > MAX_FORMAT_CHARS:  # compiling grows faster than the size: seconds per 100 KB of grammar
            raise FormatTooLargeError(f"the format is {len(source):,} characters; at most {MAX_FORMAT_CHARS:,} "
                                        f"are taken")

    @functools.cached_property
    def llguidance_grammar(self) -> str:
        """The format as llguidance's grammar, compiled and checked once."""
        try:
            return grammar_of(self)
        except RecursionError:
            raise StructuredOutputError("the format is nested too deeply") from None

    @classmethod
    def from_dict(cls, value: StructuredOutput | dict[str, Any]) -> StructuredOutput:
        """A StructuredOutput, or one built from its fields as a dict (how it crosses a process boundary);
        StructuredOutputError for anything else."""
        if isinstance(value, StructuredOutput):
            return value
        names = [f.name for f in fields(cls)]
        if not isinstance(value, dict) or (unknown := sorted(set(value) - set(names), key=str)):
            got = f"keys {unknown}" if isinstance(value, dict) else type(value).__name__
            raise StructuredOutputError(f"structured output is a StructuredOutput or a dict of one of {names}, got "
                                        f"{got}")
        return cls(**value)


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that lists its ``properties`` and
    says nothing of other keys (no ``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties``):
    the keys a schema names are the ones generated, as xgrammar and outlines (vLLM's and SGLang's usual engines)
    do, instead of a model inventing keys until ``max_tokens``. A key that ``required`` names and ``properties``
    does not stays allowed (as ``{}``). Where a schema's keys are named in parts, the parts stay open: an ``allOf``
    and its members, an object with a ``$ref`` beside its ``properties`` and the definition it extends. The
    branches of an ``anyOf`` / ``oneOf`` beside ``properties`` are closed over their keys and the parent's (which
    they close in its stead). A local ``$ref`` in such a place means what its target written there would: the
    target is copied under a new ``$defs`` name and treated as it would be there, its other uses unchanged. A bare
    ``{"type": "object"}`` stays any object."""
    if not isinstance(schema, dict):
        return schema
    return _Closer(pointer_refs(schema)).closed_root()


_Mode = tuple[bool, tuple[str, ...]]  # (close the object itself, the parent's keys an anyOf / oneOf branch keeps)
_CLOSED: _Mode = (True, ())
_OPEN: _Mode = (False, ())


class _Closer:
    """``closed_objects`` over one schema: the copies its refs need, each made once per place it is treated as."""

    def __init__(self, root: dict) -> None:
        self.root = root
        self.defs = root["$defs"] if isinstance(root.get("$defs"), dict) else {}
        self.copies: dict[str, Any] = {}  # a new $defs name -> its closed copy
        self.names: dict[tuple[str, _Mode], str] = {}  # (a ref, how its target is treated) -> its copy's name
        self.pending: list[tuple[str, Any, _Mode]] = []  # copies still to close: walked in turn, not recursively

    def closed_root(self) -> dict:
        closed = self.closed(self.root, _CLOSED)
        while self.pending:
            name, target, mode = self.pending.pop()
            self.copies[name] = self.closed(target, mode)
        if self.copies:
            closed["$defs"] = {**(closed["$defs"] if self.defs else {}), **self.copies}
        return closed

    def closed(self, schema: Any, mode: _Mode) -> Any:
        """``schema`` closed as ``mode`` says, the copies its refs need queued."""
        if not isinstance(schema, dict):
            return schema
        close, parent_keys = mode
        closed = _with_keys(schema, parent_keys) if parent_keys else dict(schema)
        listed = isinstance(closed.get("properties"), dict)
        named = closed["properties"] if listed else {}
        required = closed.get("required") if listed and isinstance(closed.get("required"), list) else []
        unnamed = {key: {} for key in required if isinstance(key, str) and key not in named}  # any value
        for key in _SUBSCHEMA:
            if key in closed:
                closed[key] = self.closed(closed[key], _CLOSED)
        branched = False  # the parent's keys are closed by its anyOf / oneOf branches
        for key in (*_SUBSCHEMA_LISTS, "allOf"):
            if isinstance(closed.get(key), list):
                sub_mode = _OPEN if key == "allOf" else _CLOSED
                if key in ("anyOf", "oneOf") and (named or unnamed):
                    sub_mode = (True, (*named, *unnamed))
                    branched = branched or any(self._lists_properties(sub) for sub in closed[key])
                closed[key] = [self.closed(sub, sub_mode) for sub in closed[key]]
        for key in _SUBSCHEMA_MAPS:
            if isinstance(closed.get(key), dict):
                closed[key] = {name: self.closed(sub, _CLOSED) for name, sub in closed[key].items()}
        if isinstance(ref := closed.get("$ref"), str):
            closed["$ref"] = self._ref(ref, _OPEN if listed else mode)  # beside properties: extended, so open
        if close and listed and not branched and not closed.keys() & {
                "additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref"}:
            closed["properties"] = {**closed["properties"], **unnamed}
            closed["additionalProperties"] = False
        return closed

    def _ref(self, ref: str, mode: _Mode) -> str:
        """``ref``, or one to a copy of its target treated as ``mode`` says, where that differs from the target's
        treatment in its place (``$defs``, ``properties``, ... close it)."""
        target = _pointed(self.root, ref)
        if mode == _CLOSED or not isinstance(target, dict) or not target.keys() & {"properties", "$ref"}:
            return ref  # treated alike anywhere
        if (ref, mode) not in self.names:
            base = unquote(ref[1:]).rsplit("/", 1)[-1].replace("~1", "/").replace("~0", "~") or "root"
            kind = "open" if mode == _OPEN else "branch"
            taken = {*self.names.values(), *self.defs}
            name = next(n for i in itertools.count() if (n := f"{base}.{kind}{i or ''}") not in taken)
            self.names[ref, mode] = name
            self.pending.append((name, target, mode))
        return f"#/$defs/{pointer_token(self.names[ref, mode])}"

    def _lists_properties(self, branch: Any) -> bool:
        """Whether ``branch`` lists ``properties``, itself or through the refs it is made of."""
        seen: set[str] = set()
        while isinstance(branch, dict) and not isinstance(branch.get("properties"), dict) and isinstance(
                ref := branch.get("$ref"), str) and ref not in seen:
            seen.add(ref)
            branch = _pointed(self.root, ref)
        return isinstance(branch, dict) and isinstance(branch.get("properties"), dict)


def _with_keys(branch: dict, keys: tuple[str, ...]) -> dict:
    """An ``anyOf`` / ``oneOf`` branch, with the parent's keys it does not name when it lists ``properties`` (as
    ``{}``: the parent's schema for them still applies), so that closing it keeps them."""
    if not isinstance(branch.get("properties"), dict):
        return dict(branch)
    return {**branch, "properties": {**{name: {} for name in keys}, **branch["properties"]}}


def json_rule(schema: dict) -> str:
    """``schema`` as a Lark ``%json`` rule (llguidance's dialect) that generates what the ``json`` format does
    (``json_format_rule``); StructuredOutputError where that format cannot hold it. The last 128 are kept: a forced
    call's schema, made of every tool's, comes again on an agent's every turn."""
    return _json_rule(json.dumps(schema))


@functools.lru_cache(maxsize=128)
def _json_rule(schema: str) -> str:
    return json_format_rule(StructuredOutput(json=schema))


def json_format_rule(spec: StructuredOutput) -> str:
    """A ``json`` or ``json_object`` format as a Lark ``%json`` rule that generates what the format does: its schema
    as compiled (objects closed, no optional whitespace, a ``format`` llguidance does not know left unenforced)."""
    [compiled] = json.loads(spec.llguidance_grammar)["grammars"]
    if compiled.get("json_schema") is None:
        raise ValueError(f"{spec} is no JSON format")
    return f"%json {json.dumps(compiled['json_schema'])}"


def grammar_of(spec: StructuredOutput) -> str:
    """llguidance's grammar for ``spec``, validated; StructuredOutputError says what is wrong with it."""
    import llguidance  # only requests that ask for structure load it

    matcher = llguidance.LLMatcher
    schema = closed_objects(spec.json) if spec.json is not None else {"type": "object"}
    if spec.json is not None or spec.json_object:
        grammar = matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    elif spec.regex is not None:
        grammar = matcher.grammar_from_regex(spec.regex)
    elif spec.grammar is not None:
        grammar = matcher.grammar_from_lark(_lark_of(spec.grammar))
    else:
        grammar = matcher.grammar_from_regex("|".join(re.escape(c) for c in spec.choice))
    is_error, messages = matcher.validate_grammar_with_warnings(grammar)
    if is_error and spec.json is not None and all(m.startswith(_UNKNOWN_FORMAT) for m in messages):
        # JSON Schema's "format" is an annotation where the validator does not know it (pydantic writes "path",
        # "password", "binary", ...): such a format is left unenforced, as xgrammar leaves it
        grammar = matcher.grammar_from_json_schema(schema, defaults={**_JSON_OPTIONS, "lenient": True})
        is_error, messages = matcher.validate_grammar_with_warnings(grammar)
        messages = [m for m in messages if not m.startswith(_UNKNOWN_FORMAT)]
        is_error = is_error or bool(messages)  # lenient would drop any keyword it cannot enforce: refused still
    if is_error:
        message = messages[0]
        if "coerce_one_of" in message:  # an option the schema itself can set (what xgrammar always does)
            message = ("a oneOf whose branches can overlap cannot be enforced exactly; add \"x-guidance\": "
                       "{\"coerce_one_of\": true} at the schema's top level to enforce it as anyOf, or make its "
                       "branches exclusive (a const discriminator)")
        raise StructuredOutputError(f"the structured output format cannot be used: {message}")
    return grammar


def _lark_of(grammar: str) -> str:
    """``grammar`` as Lark: GBNF (llama.cpp's ``root ::= ...``, which vLLM's grammar backends take) converted by
    llguidance, as vLLM's guidance backend converts it; Lark as it is."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if "::=" not in grammar or is_lark_syntax(grammar):
        return grammar
    try:
        return gbnf_to_lark(_GBNF_ESCAPE.sub(_surviving_escape, grammar))
    except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions on a malformed grammar
        raise StructuredOutputError(f"the grammar is neither Lark nor GBNF that converts to it: {exc}") from None


def _surviving_escape(escape: re.Match[str]) -> str:
    """A GBNF ``\\u`` (4 hex digits) / ``\\U`` (8) escape in a form llguidance's converter keeps (1.9 drops its leading
    zeros: ``\\u00e9`` became ``\\ue9``, which Lark does not read): ``\\xNN`` below U+0100, which holds every
    character that needs escaping in a literal, a class or a regex, and the character itself above; anything else
    (an escaped backslash, a surrogate, past U+10FFFF) as it is."""
    digits = escape[1] or escape[2]
    code = int(digits, 16) if digits else None
    if code is None or code > 0x10FFFF or 0xD800 <= code < 0xE000:
        return escape[0]
    return f"\\x{code:02x}" if code < 0x100 else chr(code)
