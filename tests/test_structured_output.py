"""Structured output on the tiny model (random weights, the bundled byte-level BPE tokenizer): whatever the model
would say, the completion parses and validates against its format, and unconstrained requests in the same batch
are untouched."""

from __future__ import annotations

import json
import math
import re

import jsonschema_rs
import pytest

from kiln.runtime import LLM, RuntimeOptions, SamplingParams
from kiln.runtime.structured_output import (
    INTEGER_RANGE,
    MAX_SCHEMA_DEPTH,
    StructuredOutput,
    StructuredOutputError,
    closed_objects,
)
from tests.test_server_support import tiny_engine

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "enum-and-bool": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                       "ok": {"type": "boolean"}},
                      "required": ["color", "ok"], "additionalProperties": False},
    "nested-array": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "score": {"type": "number", "minimum": 0, "maximum": 100}},
            "required": ["id", "score"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "any-of-and-pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
        "required": ["code", "value"], "additionalProperties": False},
    "top-level-array": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 2,
                        "maxItems": 4},
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def constrained(spec: dict, seed: int, max_tokens: int = 120, **params) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_output=spec, **params)


@pytest.mark.parametrize("name", SCHEMAS)
def test_sampled_json_parses_and_validates_against_its_schema(llm, name):
    schema = SCHEMAS[name]
    outputs = llm.generate(["Give me JSON:"] * 3, [constrained({"json": schema}, seed) for seed in range(3)])
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        assert jsonschema_rs.validator_for(schema).is_valid(json.loads(output.text)), output.text


def test_json_object_regex_choice_and_grammar_formats(llm):
    prompts = ["Answer:"] * 4
    quote = llm.tokenizer.encode('"', add_special_tokens=False)
    # random weights write endless keys: a bias towards the closing quote lets the object end within max_tokens
    params = [constrained({"json_object": True}, 0, logit_bias={quote[0]: 6.0}),
              constrained({"regex": r"[0-9]{3}-[a-z]{2,4}"}, 2),
              constrained({"choice": ["yes", "no", "maybe (later)"]}, 3),
              constrained({"grammar": 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]/'},
                          4)]
    obj, code, choice, expr = llm.generate(prompts, params)
    assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", code.text)
    assert choice.text in ("yes", "no", "maybe (later)")
    assert re.fullmatch(r"[0-9()+*]+", expr.text) and expr.text.count("(") == expr.text.count(")")
    assert all(o.finish_reason == "stop" for o in (obj, code, choice, expr))


def test_logprobs_of_a_constrained_request_are_over_the_tokens_its_format_allows(llm):
    # as vLLM's: the grammar mask comes before the log-softmax, so "yes" and "no" share the whole probability
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, structured_output={"choice": ["yes", "no"]})
    first = llm.generate(["Answer:"], params)[0].logprobs[0]
    texts = {llm.tokenizer.decode([token]) for token, _ in first.top}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert math.isclose(sum(math.exp(logprob) for _, logprob in first.top), 1.0, rel_tol=1e-4)


@pytest.mark.parametrize("overlap", [True, False])
def test_unconstrained_requests_in_the_same_batch_are_untouched(overlap):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM.load(tiny_engine(), RuntimeOptions(overlap_steps=overlap)) as llm:
        alone = llm.generate(["Once upon a time"], free)[0].token_ids
        mixed = llm.generate(["Once upon a time", "Give me JSON:", "Give me JSON:"],
                             [free, constrained({"json": SCHEMAS["flat"]}, 5),
                              constrained({"json": SCHEMAS["enum-and-bool"]}, 6)])
    assert mixed[0].token_ids == alone
    for output in mixed[1:]:
        assert isinstance(json.loads(output.text), dict)


def test_a_schema_that_lists_its_properties_gets_those_keys_only(llm):
    # no additionalProperties: random weights used to write a new key after "a" until max_tokens
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "boolean"}}, "required": ["a"]}
    for output in llm.generate(["Give me JSON:"] * 3, [constrained({"json": schema}, seed) for seed in range(3)]):
        assert output.finish_reason == "stop", output.text
        value = json.loads(output.text)
        assert "a" in value and set(value) <= {"a", "b"}, output.text


def test_objects_are_closed_where_the_schema_says_nothing_of_other_keys():
    free_map = {"type": "object", "additionalProperties": {"type": "integer"}}
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "string"}}},  # a key named "properties"
        "tags": {"type": "array", "items": {"properties": {"k": {}}}},
        "counts": free_map, "any": {"type": "object"}, "ref": {"$ref": "#/$defs/point"},
        "both": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]}},
        "$defs": {"point": {"properties": {"x": {}, "y": {}}}}}
    closed = closed_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["properties"]["additionalProperties"] is False
    assert set(props["properties"]) == {"type", "properties", "additionalProperties"}  # not a property added
    assert props["tags"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["point"]["additionalProperties"] is False
    assert props["counts"] == free_map and props["any"] == {"type": "object"}  # open by their own words
    assert all("additionalProperties" not in branch for branch in props["both"]["allOf"])  # each names a part
    assert "additionalProperties" not in schema  # the caller's schema is not changed


TAGGED_UNION = {"type": "object", "properties": {"kind": {"enum": ["x", "y"]}}, "required": ["kind"],
                "anyOf": [{"properties": {"kind": {"const": "x"}, "xv": {"type": "integer"}}, "required": ["xv"]},
                          {"properties": {"kind": {"const": "y"}, "yv": {"type": "boolean"}}, "required": ["yv"]}]}


def test_a_tagged_union_and_an_extended_definition_compile_and_hold(llm):
    extended = {"$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
                "$ref": "#/$defs/base", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
    closed = closed_objects(TAGGED_UNION)
    assert "additionalProperties" not in closed and all(b["additionalProperties"] is False for b in closed["anyOf"])
    assert set(closed["anyOf"][0]["properties"]) == {"kind", "xv"}  # the parent's keys kept in each branch
    closed = closed_objects(extended)
    assert closed["$ref"] == "#/$defs/base.open" and "additionalProperties" not in closed["$defs"]["base.open"]
    assert closed["$defs"]["base"]["additionalProperties"] is False  # extended through an open copy: others closed
    assert StructuredOutput(json=extended).llguidance_grammar  # compiles (it was refused as unsatisfiable)
    outputs = llm.generate(["Give me JSON:"] * 3, [constrained({"json": TAGGED_UNION}, seed) for seed in range(3)])
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        assert jsonschema_rs.validator_for(TAGGED_UNION).is_valid(json.loads(output.text)), output.text


def test_a_gbnf_grammar_and_an_unknown_string_format_are_taken_as_vllm_takes_them(llm):
    output = llm.generate(["Answer:"], constrained({"grammar": 'root ::= "yes" | "no"'}, 1))[0]
    assert output.text in ("yes", "no") and output.finish_reason == "stop"
    assert StructuredOutput(json={"type": "string", "format": "path"}).llguidance_grammar  # pydantic's Path
    paths = {"type": "string", "format": "path"}
    unique = StructuredOutput(json={"type": "array", "uniqueItems": True, "items": paths})
    with pytest.raises(StructuredOutputError, match="uniqueItems"):  # a keyword it cannot enforce: refused still
        unique.llguidance_grammar  # noqa: B018 - compiling is what is under test


def test_an_overlapping_one_of_is_refused_naming_the_schema_option_that_enforces_it_as_any_of():
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    with pytest.raises(StructuredOutputError, match=r'add "x-guidance": \{"coerce_one_of": true\} at the schema'):
        StructuredOutput(json=overlapping).llguidance_grammar  # noqa: B018 - compiling is what is under test
    assert StructuredOutput(json={**overlapping, "x-guidance": {"coerce_one_of": True}}).llguidance_grammar


def test_a_format_too_large_or_too_deep_to_compile_in_time_is_refused_naming_why():
    with pytest.raises(StructuredOutputError, match="characters; at most 131,072"):
        StructuredOutput(grammar="start: " + " | ".join(f'"w{i}x"' for i in range(30_000)))
    with pytest.raises(StructuredOutputError, match="nested too deeply"):  # too deep for json.loads on Python 3.11
        StructuredOutput(json='{"a":' * 5000 + "1" + "}" * 5000)
    deep = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):  # each level two: the object, its properties
        deep = {"type": "object", "properties": {"a": deep}}
    assert StructuredOutput(json=deep).llguidance_grammar  # 119 levels
    with pytest.raises(StructuredOutputError, match="at most 120 levels"):  # parses on any Python, but deeper
        StructuredOutput(json={"type": "object", "properties": {"a": deep}})


@pytest.mark.parametrize("schema", [{"type": "integer", "maximum": 2**64}, {"const": 10**20},
                                    {"type": "string", "maxLength": 10**20}, {"minimum": -10**30},
                                    {"const": -2**63 + 1}])  # llguidance segfaulted on this one
def test_an_integer_the_grammar_engine_does_not_take_is_refused_naming_it(schema):
    # llguidance raised a bare ValueError ("Value is not JSON serializable"): a 500 where a request's format is wrong
    number = re.escape(str(next(v for v in schema.values() if isinstance(v, int))))
    with pytest.raises(StructuredOutputError, match=f"schema holds the number {number}, outside the integers the "
                                                    f"grammar engine takes"):
        SamplingParams(structured_output=StructuredOutput(json=schema))
    with pytest.raises(StructuredOutputError, match=f"a %json schema of the grammar holds the number {number}"):
        StructuredOutput(grammar=f"start: %json {json.dumps(schema)}")


def test_integers_at_the_edges_of_the_range_or_past_the_digits_python_reads():
    assert StructuredOutput(json={"enum": [INTEGER_RANGE[0], INTEGER_RANGE[-1]]}).llguidance_grammar
    with pytest.raises(StructuredOutputError, match="holds an integer of thousands of digits, outside the integers"):
        StructuredOutput(json='{"const": ' + "1" * 5000 + "}")
    with pytest.raises(StructuredOutputError, match="number out of range"):  # llguidance names it in a grammar
        StructuredOutput(grammar='start: %json {"const": ' + "1" * 5000 + "}").llguidance_grammar  # noqa: B018


def chained(links: int) -> dict:
    """A schema of ``links`` definitions, each an object whose one property is the next: shallow as JSON."""
    definitions = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                   for i in range(links)}
    return {"$ref": "#/$defs/d0", "$defs": {**definitions, f"d{links}": {"type": "string"}}}


def test_refs_or_rules_chained_past_what_llguidance_compiles_without_crashing_are_refused():
    # llguidance compiles them recursively: 1,000 chained refs (75 KB) or 3,000 chained rules overflowed the stack
    # and killed the server, every other request with it
    with pytest.raises(StructuredOutputError, match="follows 1,?001 \\$refs one inside another; at most 128"):
        StructuredOutput(json=chained(1000))
    assert StructuredOutput(json=chained(120)).llguidance_grammar
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}  # recursion is no chain
    diamond = {"$ref": "#/$defs/d0", "$defs": {**{f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2}
                                                  for i in range(40)}, "d40": {"type": "string"}}}
    assert StructuredOutput(json=tree).llguidance_grammar and StructuredOutput(json=diamond).llguidance_grammar
    rules = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1} | "c"' for i in range(3000)) + '\nr3000: "b"\n'
    with pytest.raises(StructuredOutputError, match="the grammar has 3,002 rules; at most 1,000"):
        StructuredOutput(grammar=rules)
    embedded = f'start: "x" obj\nobj: %json {json.dumps(chained(1000))}\n'  # a schema inside a grammar too
    with pytest.raises(StructuredOutputError, match="a %json schema of the grammar follows 1,?001 \\$refs"):
        StructuredOutput(grammar=embedded)
    assert StructuredOutput(grammar=f'start: "x" obj\nobj: %json {json.dumps(chained(20))}\n').llguidance_grammar


@pytest.mark.parametrize(("fields", "message"), [
    ({"choice": ["a", 1]}, "choice must be a non-empty list"),
    ({"choice": "ab"}, "choice must be a non-empty list"),
    ({"regex": 5}, "regex must be a string, got int"),
    ({"grammar": ["start: x"]}, "grammar must be a string, got list"),
    ({"json_object": "yes"}, "json_object must be true or false"),
])
def test_a_format_field_of_the_wrong_type_is_refused_as_a_structured_output_error(fields, message):
    with pytest.raises(StructuredOutputError, match=message):
        StructuredOutput(**fields)


def test_a_format_cut_short_by_max_tokens_ends_with_length(llm):
    output = llm.generate(["x"], constrained({"json": SCHEMAS["nested-array"]}, 7, max_tokens=3))[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 3


@pytest.mark.parametrize(("spec", "words"), [
    ({"regex": "(["}, "unclosed character class"),
    ({"json": {"type": "frob"}}, "frob"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"choice": [""]}, "non-empty list"),
    ({"schema": {}}, "a dict of one of ['json', 'json_object', 'regex', 'grammar', 'choice'], got keys ['schema']"),
    ("a+", "got str"),
])
def test_a_format_that_cannot_compile_is_refused_when_the_parameters_are_made(spec, words):
    with pytest.raises(StructuredOutputError, match=re.escape(words)):
        SamplingParams(structured_output=spec)


def test_structured_output_crosses_the_engine_process():
    schema = SCHEMAS["enum-and-bool"]
    with LLM.load(tiny_engine(), RuntimeOptions(engine_process=True)) as llm:
        output = llm.generate(["JSON:"], constrained({"json": schema}, 8))[0]
    assert jsonschema_rs.validator_for(schema).is_valid(json.loads(output.text))
    assert StructuredOutput.from_dict({"json_object": True}).json_object


def test_a_constrained_request_keeps_the_steps_overlapped_and_gets_a_token_every_step():
    with LLM.load(tiny_engine(), RuntimeOptions(overlap_steps=True)) as llm:
        before = llm.stats()
        output = llm.generate(["JSON:"], constrained({"json": SCHEMAS["nested-array"]}, 9))[0]
        after = llm.stats()
    tokens = len(output.token_ids)
    assert tokens > 10 and after["num_steps"] - before["num_steps"] <= tokens + 1
    assert after["num_steps_queued_ahead"] - before["num_steps_queued_ahead"] >= tokens - 2


def test_a_tokenizer_llguidance_cannot_read_fails_the_constrained_request_only(tmp_path):
    import shutil

    engine = shutil.copytree(tiny_engine(), tmp_path / "engine")
    tokenizer = json.loads((engine / "tokenizer.json").read_text())
    tokenizer["decoder"] = None  # e.g. a word-level tokenizer: the bytes of its tokens are unknown
    (engine / "tokenizer.json").write_text(json.dumps(tokenizer))
    with LLM.load(engine) as llm:
        with pytest.raises(StructuredOutputError, match="cannot use this engine's tokenizer.json"):
            llm.generate(["JSON:"], constrained({"json_object": True}, 1))
        assert len(llm.generate(["JSON:"], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_a_format_that_outgrows_llguidance_while_generating_fails_its_request_naming_why(llm):
    from kiln.runtime.outputs import RequestFailedError

    generated = llm.stats()["num_generated_tokens"]
    with pytest.raises(StructuredOutputError, match="outgrew what llguidance can track") as failed:
        llm.generate(["x"], SamplingParams(max_tokens=40, structured_output={"regex": "a{1000}{1000}"}))
    assert llm.stats()["num_generated_tokens"] == generated  # the refused token is no output (vLLM's metric)
    assert not isinstance(failed.value, RequestFailedError) and "\n" not in str(failed.value)  # no state dump
    assert llm.generate(["x"], SamplingParams(max_tokens=2))[0].finish_reason == "length"  # the engine serves on


def test_a_format_no_output_satisfies_fails_its_request_instead_of_returning_empty_text(llm):
    generated, errors = llm.stats()["num_generated_tokens"], llm.stats()["requests_finished"]["error"]
    with pytest.raises(StructuredOutputError, match=r"cannot go on after 0 tokens \(NoExtensionBias\)"):
        llm.generate(["x"], SamplingParams(max_tokens=8, structured_output={"json": {"$ref": "#"}}))
    assert llm.stats()["num_generated_tokens"] == generated
    assert llm.stats()["requests_finished"]["error"] == errors + 1  # vLLM V1's reason, as /metrics counts it
    assert llm.generate(["x"], SamplingParams(max_tokens=2))[0].finish_reason == "length"  # the engine serves on


def test_a_format_spells_out_added_tokens_that_tokenizer_json_marks_as_text(tmp_path):
    """Qwen's ``<tool_call>`` and ``<think>``: one added token each, ``special: false``. The format forcing that text
    allows the token and takes it (llguidance's own reading took them as special: the forced token failed)."""
    import shutil

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HfTokenizer

    from kiln.runtime.native.grammar import Grammars
    from kiln.runtime.tokenizer import Tokenizer

    hf = HfTokenizer.from_file(str(tiny_engine() / "tokenizer.json"))
    hf.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<tool_call>", "</tool_call>")])
    hf.save(str(tmp_path / "tokenizer.json"))
    shutil.copy(tiny_engine() / "tokenizer_config.json", tmp_path)
    tokenizer = Tokenizer.from_dir(tmp_path)
    text = '<tool_call>\n{"a": 1}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert {tokenizer.token_id("<tool_call>"), tokenizer.token_id("</tool_call>")} <= set(ids)
    grammars = Grammars(tokenizer, tokenizer.vocab_size, [tokenizer.vocab_size - 1])
    matcher = grammars.matcher(StructuredOutput.from_dict({"regex": re.escape(text)}))
    for token_id in ids:
        mask = grammars.bitmask([matcher])[0]
        assert mask[token_id // 32] >> (token_id % 32) & 1, tokenizer.decode([token_id])
        assert matcher.consume_token(token_id), matcher.get_error()
    assert matcher.is_accepting()
