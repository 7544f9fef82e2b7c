"""Tool parameters that carry a root ``$id`` (as pydantic, zod and MCP servers may write them) hold a forced call to
what their refs mean, whether a ref names a place locally, through that ``$id``, a subschema's ``$id`` or an
``$anchor``, percent-encoded or not; a ref to a schema elsewhere is still refused, and refs chained through a ``$id``
are counted."""

from __future__ import annotations

import functools

import pytest

from kiln.runtime.native.grammar import Grammars
from kiln.runtime.server.tool_calls import HERMES
from kiln.runtime.structured_output import MAX_REF_CHAIN, StructuredOutput, StructuredOutputError
from kiln.runtime.tokenizer import Tokenizer
from tests.test_server_support import TOKENIZER_SOURCE

ID = "https://example.com/tools/args.json"


def with_id(x: dict, defs: dict) -> dict:
    """Parameters with a root ``$id`` and ``$schema``, an integer ``x`` reached through ``x``'s schema."""
    return {"$id": ID, "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
            "properties": {"x": x}, "required": ["x"], "$defs": defs}


INTEGER = {"item": {"type": "integer"}}


@functools.cache
def grammars() -> Grammars:
    tokenizer = Tokenizer.from_dir(TOKENIZER_SOURCE)
    [eos] = tokenizer.encode("</s>", add_special_tokens=False)
    return Grammars(tokenizer, tokenizer.vocab_size, [eos])


def accepts(tools: list[dict], text: str) -> bool:
    """Whether the grammar of one forced call of ``tools`` (Hermes' format) takes ``text``."""
    matcher = grammars().matcher(StructuredOutput(grammar=HERMES.grammar(tools, False)))
    ids = grammars().tokenizer.encode(f"<tool_call>\n{text}\n</tool_call>", add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("parameters", [
    with_id({"$ref": "#/$defs/item"}, INTEGER),
    with_id({"$ref": f"{ID}#/$defs/item"}, INTEGER),
    with_id({"$ref": "args.json#/$defs/item"}, INTEGER),
    with_id({"$ref": "item.json"}, {"item": {"$id": "item.json", "type": "integer"}}),
    with_id({"$ref": "#item"}, {"item": {"$anchor": "item", "type": "integer"}}),
], ids=["local", "through-the-id", "relative-to-the-id", "a-subschema-id", "an-anchor"])
def test_a_forced_call_follows_parameters_with_a_root_id_as_their_refs_mean(parameters):
    tools = [{"name": "f", "parameters": parameters}]
    assert accepts(tools, '{"name":"f","arguments":{"x":1}}')  # before: the grammar did not compile (a 400)
    assert not accepts(tools, '{"name":"f","arguments":{"x":"a"}}')


@pytest.mark.parametrize(("name", "ref"), [
    ("A B", "#/$defs/A%20B"), ("a/b", "#/$defs/a~1b"), ("x~y", "#/$defs/x~0y"), ("é", "#/$defs/%C3%A9"),
    ("A B", f"{ID}#/$defs/A%20B"),
], ids=["a-space", "a-slash", "a-tilde", "unicode", "a-space-through-the-id"])
def test_refs_to_definitions_whose_names_a_uri_must_encode_hold_a_forced_call(name, ref):
    parameters = {"type": "object", "properties": {"x": {"$ref": ref}}, "required": ["x"],
                  "$defs": {name: {"type": "integer"}}, **({"$id": ID} if ref.startswith(ID) else {})}
    tools = [{"name": "f", "parameters": parameters}]
    assert accepts(tools, '{"name":"f","arguments":{"x":1}}')  # before: "#/$defs/A%20B" was left unhoisted (a 400)
    assert not accepts(tools, '{"name":"f","arguments":{"x":"a"}}')


def test_two_tools_sharing_an_id_each_keep_their_own_definitions():
    tools = [{"name": "f", "parameters": with_id({"$ref": f"{ID}#/$defs/item"}, INTEGER)},
             {"name": "g", "parameters": with_id({"$ref": f"{ID}#/$defs/item"}, {"item": {"type": "string"}})}]
    assert accepts(tools, '{"name":"f","arguments":{"x":1}}') and accepts(tools, '{"name":"g","arguments":{"x":"a"}}')
    assert not accepts(tools, '{"name":"f","arguments":{"x":"a"}}')
    assert not accepts(tools, '{"name":"g","arguments":{"x":1}}')


def test_a_ref_to_a_schema_elsewhere_is_still_refused_naming_it():
    tools = [{"name": "f", "parameters": with_id({"$ref": "https://example.org/other.json"}, {})}]
    with pytest.raises(StructuredOutputError, match="https://example.org/other.json"):
        _ = StructuredOutput(grammar=HERMES.grammar(tools, False)).llguidance_grammar


def test_refs_chained_through_the_root_id_count_against_the_limit():
    defs = {f"d{i}": {"$ref": f"args.json#/$defs/d{i + 1}"} for i in range(MAX_REF_CHAIN + 1)}
    defs[f"d{MAX_REF_CHAIN + 1}"] = {"type": "integer"}
    with pytest.raises(StructuredOutputError, match="refs one inside another"):  # before: uncounted (thousands of
        StructuredOutput(json=with_id({"$ref": "args.json#/$defs/d0"}, defs))  # them crashed llguidance)


def test_data_under_const_and_enum_is_enforced_as_written_not_read_as_schema():
    thing = {"$id": "https://schema.org/Thing", "name": "x"}  # a "$id" in data: before, dropped from the const
    ref = {"$ref": "#/$defs/item"}  # a "$ref" in data: before, rewritten to the hoisted definition's name
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"c": {"const": thing}, "e": {"enum": [ref]}},
                                          "required": ["c", "e"], "$defs": INTEGER}}]
    assert accepts(tools, '{"name":"f","arguments":{"c":{"$id":"https://schema.org/Thing","name":"x"},'
                          '"e":{"$ref":"#/$defs/item"}}}')
    assert not accepts(tools, '{"name":"f","arguments":{"c":{"name":"x"},"e":{"$ref":"#/$defs/item"}}}')


def test_properties_named_like_keywords_are_names_and_their_schemas_are_followed():
    properties = {"$id": {"type": "string"}, "$ref": {"type": "string"}, "const": {"$ref": f"{ID}#/$defs/item"}}
    tools = [{"name": "f", "parameters": {"$id": ID, "type": "object", "properties": properties,
                                          "required": list(properties), "$defs": INTEGER}}]
    assert accepts(tools, '{"name":"f","arguments":{"$id":"a","$ref":"b","const":1}}')
    assert not accepts(tools, '{"name":"f","arguments":{"$id":"a","$ref":"b","const":"c"}}')


def test_refs_inside_const_data_do_not_count_as_a_chain():
    links = {f"k{i}": {"$ref": f"#/properties/c/const/k{i + 1}"} for i in range(MAX_REF_CHAIN + 1)}
    StructuredOutput(json={"type": "object", "properties": {"c": {"const": links}}})  # before: refused, 129 refs
