"""Closing a JSON schema's objects treats a ``$ref`` as the schema it names written in its place (an ``allOf``
member, an ``anyOf`` / ``oneOf`` branch beside ``properties``), keeps a key that ``required`` names without a
schema; GBNF ``\\u`` escapes mean what llama.cpp reads.
Checked on the bundled tokenizer: what a format accepts, and seeded random walks over its token masks."""

from __future__ import annotations

import functools
import json
import random

import jsonschema_rs
import numpy as np
import pytest

from kiln.runtime.native.grammar import Grammars
from kiln.runtime.server.tool_calls import HERMES
from kiln.runtime.structured_output import StructuredOutput, closed_objects
from kiln.runtime.tokenizer import Tokenizer
from tests.test_server_support import TOKENIZER_SOURCE

DEFS = {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
        "Flag": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}
NAME = {"type": "object", "properties": {"name": {"enum": ["x", "y"]}}, "required": ["name"]}
BASE = {"$ref": "#/$defs/Base"}
REF_PLACES = {  # each with its $defs added; "p" uses Base as it is, which stays closed
    "allOf-of-refs": {"allOf": [BASE, NAME]},
    "allOf-beside-properties": {"allOf": [BASE], **NAME},
    "allOf-in-a-field": {"type": "object", "properties": {"f": {"allOf": [BASE, NAME]}, "p": BASE},
                         "required": ["f"]},
    "anyOf-of-refs-beside-properties": {**NAME, "anyOf": [BASE, {"$ref": "#/$defs/Flag"}]},
}
TEXTS = ['{"id":1,"name":"x"}', '{"name":"x","id":1}', '{"name":"x"}', '{"id":1}', '{"id":1,"name":"x","z":0}',
         '{"name":"x","on":true}', '{"name":"x","on":true,"id":1}', '{"f":{"id":1,"name":"x"},"p":{"id":2}}',
         '{"f":{"id":1,"name":"x"},"p":{"id":2,"z":0}}', '{"f":{"name":"y"}}']


@functools.cache
def grammars() -> Grammars:
    tokenizer = Tokenizer.from_dir(TOKENIZER_SOURCE)
    return Grammars(tokenizer, tokenizer.vocab_size, tokenizer.encode("</s>", add_special_tokens=False))


def accepts(spec: StructuredOutput, text: str) -> bool:
    matcher, ids = grammars().matcher(spec), grammars().tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def sampled(spec: StructuredOutput, seed: int, max_tokens: int = 120) -> str | None:
    """A completion of ``spec`` by a seeded random walk over the tokens its masks allow; None when cut short."""
    rng, matcher, ids = random.Random(seed), grammars().matcher(spec), []
    for _ in range(max_tokens):
        bits = np.unpackbits(grammars().bitmask([matcher])[0].view(np.uint8), bitorder="little")
        token = rng.choice(np.flatnonzero(bits[:grammars().vocab_size]).tolist())
        if token in grammars().eos_token_ids:
            return grammars().tokenizer.decode(ids)
        assert matcher.consume_token(token)
        ids.append(token)
    return None


def inline(schema: object) -> object:
    """``schema`` with each ref to ``DEFS`` replaced by the definition it names."""
    if isinstance(schema, list):
        return [inline(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if schema.get("$ref", "").startswith("#/$defs/"):
        return DEFS[schema["$ref"].removeprefix("#/$defs/")]
    return {key: inline(value) for key, value in schema.items()}


@pytest.mark.parametrize("name", REF_PLACES)
def test_a_ref_where_closing_treats_a_schema_apart_means_the_schema_written_there(name):
    # the ref form was refused ("required property 'name' is unsatisfiable") or closed the parent's keys out
    by_ref = StructuredOutput(json={"$defs": DEFS, **REF_PLACES[name]})
    written = StructuredOutput(json=inline(REF_PLACES[name]))
    assert [accepts(by_ref, t) for t in TEXTS] == [accepts(written, t) for t in TEXTS]
    assert any(accepts(by_ref, t) for t in TEXTS)


@pytest.mark.parametrize("schema", [
    {"$defs": DEFS, **REF_PLACES["allOf-in-a-field"]}, {"$defs": DEFS, **REF_PLACES["anyOf-of-refs-beside-properties"]},
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a", "b"]},  # b: any value
], ids=["allOf", "anyOf", "required-not-listed"])
def test_sampled_outputs_of_such_schemas_validate(schema):
    outputs = [sampled(StructuredOutput(json=schema), seed) for seed in range(6)]
    assert any(outputs)
    for text in filter(None, outputs):
        assert jsonschema_rs.validator_for(schema).is_valid(json.loads(text)), text


def test_a_definition_extended_by_ref_is_copied_open_and_stays_closed_elsewhere():
    closed = closed_objects({"$defs": DEFS, **REF_PLACES["allOf-in-a-field"]})
    assert closed["properties"]["f"]["allOf"][0] == {"$ref": "#/$defs/Base.open"}
    assert "additionalProperties" not in closed["$defs"]["Base.open"]
    assert closed["$defs"]["Base"]["additionalProperties"] is False and closed["properties"]["p"] == BASE


def test_a_tool_whose_parameters_extend_a_definition_can_be_called():
    tool = {"name": "f", "parameters": {"$defs": DEFS, **REF_PLACES["allOf-of-refs"]}}
    call = StructuredOutput(grammar=HERMES.grammar([tool], False))
    assert accepts(call, '<tool_call>\n{"name":"f","arguments":{"id":1,"name":"x"}}\n</tool_call>')


def test_a_required_key_that_properties_does_not_list_stays_allowed_in_a_closed_object():
    spec = StructuredOutput(json={"type": "object", "properties": {"a": {}}, "required": ["a", "b"]})
    assert accepts(spec, '{"a":1,"b":[true]}')
    assert not accepts(spec, '{"a":1}') and not accepts(spec, '{"a":1,"b":2,"c":3}')


def test_a_map_with_min_properties_compiles_as_tools_send_it():
    # a tool's map parameter: compiled on every request whatever tool_choice is, so a refusal would fail them all
    assert StructuredOutput(json={"type": "object", "additionalProperties": {"type": "string"},
                                  "minProperties": 2}).llguidance_grammar


@pytest.mark.parametrize(("grammar", "taken", "refused"), [
    (r'root ::= [^\u0000-\u001f"]{1,3}', "aé中", 'a"'),
    (r'root ::= "\u00e9" "\u4e2d" "\u0100"', "é中Ā", "e中Ā"),
    (r'root ::= [\u00e0-\u00ff] [\U0001F600]', "é😀", "a😀"),
    (r'root ::= "\\u00e9" [\u005d\u002d]', "\\u00e9-", "é]"),  # an escaped backslash, then "u00e9"
])
def test_gbnf_unicode_escapes_mean_the_characters_llama_cpp_reads(grammar, taken, refused):
    # llguidance's converter dropped their leading zeros: "\ue9" is no Lark, [^\u-\u1f"] no regex
    spec = StructuredOutput(grammar=grammar)
    assert accepts(spec, taken) and not accepts(spec, refused)
