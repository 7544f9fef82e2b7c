"""Tool calling under tool_choice auto: beside a response_format (an agent's output type, sent on every turn) the
model may still call a tool; every tool's parameters are checked; tools given as an empty list reach the template;
streams send no empty deltas while they hold a call back; Mistral's content before its calls, and JSON in its content
streamed as it comes; a JSON Schema format llguidance does not know left unenforced in calls; parameters compiled
once."""

from __future__ import annotations

import asyncio
import json
from dataclasses import astuple, dataclass
from types import SimpleNamespace

import httpx
import jsonschema_rs
import openai
import pytest

from kiln.runtime import LLM, SamplingParams, structured_output
from kiln.runtime.native.grammar import Grammars
from kiln.runtime.server import chat
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.protocol import ChatCompletionRequest
from kiln.runtime.server.tool_calls import HERMES, LLAMA3_JSON, MISTRAL, ToolCallFormat, tool_call_format
from kiln.runtime.structured_output import StructuredOutput, json_format_rule
from tests.test_server_support import tiny_engine
from tests.test_server_tools import (
    CLOCK,
    HERMES_TEMPLATE,
    MESSAGES,
    MISTRAL_TEMPLATE,
    MODEL,
    TEMPLATES,
    assert_valid_call,
    client_for,
)

ANSWER = {"type": "object", "properties": {"reply": {"enum": ["yes", "no"]}}, "required": ["reply"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
FIRST_OF_A_CALL = {"hermes": "<", "mistral": "["}  # the call's first character, where the answer's is "{"
LOGIN = {"type": "function", "function": {"name": "login", "parameters": {  # pydantic's SecretStr: "password"
    "type": "object", "properties": {"pw": {"type": "string", "format": "password", "maxLength": 8}},
    "required": ["pw"]}}}


@pytest.fixture(scope="module")
def llm():
    with LLM.load(tiny_engine(max_seq_len=1024, max_input_len=896)) as llm:
        yield llm


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)


def bias_to(llm, character: str) -> dict[str, int]:
    """A logit bias that makes ``character``'s token the model's first choice wherever the format allows it."""
    [token] = llm.tokenizer.encode(character, add_special_tokens=False)
    return {str(token): 100}


@pytest.mark.parametrize("name", list(FIRST_OF_A_CALL))
def test_auto_beside_response_format_lets_the_model_call_a_tool_or_answer_in_the_format(llm, tmp_path_factory, name):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[CLOCK], response_format=RESPONSE_FORMAT, max_tokens=60,
                  parallel_tool_calls=False, seed=1)
    with client_for(llm, tmp_path_factory, TEMPLATES[name]) as server, openai_client(server) as client:
        called = client.chat.completions.create(logit_bias=bias_to(llm, FIRST_OF_A_CALL[name]), **kwargs)
        streamed = [c.choices[0] for c in client.chat.completions.create(
            stream=True, logit_bias=bias_to(llm, FIRST_OF_A_CALL[name]), **kwargs) if c.choices]
        answered = client.chat.completions.create(logit_bias=bias_to(llm, "{"), **kwargs).choices[0]
    choice = called.choices[0]  # before: the schema's grammar from the first token, so never a call
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_call(choice.message.tool_calls[0], CLOCK)
    assert [p.function.arguments for c in streamed for p in c.delta.tool_calls or []] == [
        choice.message.tool_calls[0].function.arguments]
    assert answered.finish_reason == "stop" and answered.message.tool_calls is None
    assert jsonschema_rs.validator_for(ANSWER).is_valid(json.loads(answered.message.content))


@pytest.mark.parametrize(("format_", "call"), [
    (HERMES, '<tool_call>\n{"name":"get_time","arguments":{"zone":"utc"}}\n</tool_call>'),
    (LLAMA3_JSON, '{"name":"get_time","parameters":{"zone":"utc"}}'),
    (MISTRAL, '[{"name":"get_time","arguments":{"zone":"utc"}}]'),
])
def test_the_grammar_of_auto_beside_a_json_format_takes_a_call_or_the_answer_and_nothing_else(llm, format_, call):
    [eos] = llm.tokenizer.encode("</s>", add_special_tokens=False)
    grammars = Grammars(llm.tokenizer, llm.tokenizer.vocab_size, [eos])

    def accepts(answer: StructuredOutput, text: str) -> bool:
        spec = StructuredOutput(grammar=format_.grammar([CLOCK["function"]], False, json_format_rule(answer)))
        matcher, ids = grammars.matcher(spec), llm.tokenizer.encode(text, add_special_tokens=False)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()

    schema, any_object = StructuredOutput(json=ANSWER), StructuredOutput(json_object=True)
    for answer in (schema, any_object):
        assert accepts(answer, call) and accepts(answer, '{"reply":"yes"}')
        assert not accepts(answer, "Sure, let me check.") and not accepts(answer, f"Sure. {call}")
    assert not accepts(schema, '{"reply":"maybe"}') and accepts(any_object, '{"reply":"maybe"}')


def test_tools_given_as_an_empty_list_reach_the_template_as_llm_chat_passes_them(llm, tmp_path_factory):
    template = ("{%- if tools is not none %}Tools: {{ tools | tojson }}\n{% endif %}"  # Llama 3.1's test
                "{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    rendered = llm.chat(MESSAGES, SamplingParams(max_tokens=1), chat_template=template, tools=[])[0].prompt_token_ids
    bare = llm.chat(MESSAGES, SamplingParams(max_tokens=1), chat_template=template)[0].prompt_token_ids
    with client_for(llm, tmp_path_factory, template) as server, openai_client(server) as client, \
            httpx.Client(base_url=server.url) as http:
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[], max_tokens=1)
        tokens = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": []}).json()["tokens"]
    assert len(rendered) > len(bare)  # before: the server rendered [] as no tools
    assert tokens == rendered and chat.usage.prompt_tokens == len(rendered)
    with client_for(llm, tmp_path_factory, None) as server, openai_client(server) as client, \
            httpx.Client(base_url=server.url) as http:  # a template that renders no tools takes none
        assert client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[], max_tokens=1).choices
        assert http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": []}).status_code == 200


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"a": {"type": "strin"}}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    {"type": "object", "required": "a"},
])
def test_every_tools_parameters_are_checked_whatever_tool_choice_is(llm, tmp_path_factory, parameters):
    bad = {"type": "function", "function": {"name": "bad", "parameters": parameters}}
    with client_for(llm, tmp_path_factory, HERMES_TEMPLATE) as server, openai_client(server) as client:
        for choice in ("auto", "none", "required"):  # before: 200 under auto and none
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=[CLOCK, bad],
                                               tool_choice=choice)
            assert refused.value.param == "tools[1].function.parameters" and "'bad'" in refused.value.message


def test_a_stream_sends_no_empty_delta_while_it_holds_a_call_back(llm, tmp_path_factory):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 日本", "unit": "c"}}\n</tool_call>'
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with client_for(llm, tmp_path_factory, HERMES_TEMPLATE) as server, openai_client(server) as client:
        chunks = [c.choices[0] for c in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[weather], max_tokens=200, stream=True,
            extra_body={"structured_outputs": {"choice": [call]}}) if c.choices]
    assert chunks[0].delta.role == "assistant"
    for chunk in chunks[1:]:  # before: {"content": ""} for each byte of "ü" and "日本" that ended no character
        assert chunk.delta.content or chunk.delta.tool_calls or chunk.finish_reason, chunk
    assert [c.function.name for chunk in chunks for c in chunk.delta.tool_calls or []] == ["get_weather"]


def test_mistral_content_before_the_calls_is_content_and_the_calls_are_calls(llm, tmp_path_factory):
    array = '[{"name": "get_time", "arguments": {"zone": "utc"}}]'
    for text in (f"Let me check. [TOOL_CALLS] {array}", f"Let me check. {array}"):  # the marker as text, or left out
        content, calls = MISTRAL.parse(text, {"get_time"})
        assert content == "Let me check." and [(c.name, c.arguments) for c in calls] == [("get_time",
                                                                                          '{"zone": "utc"}')]
    assert MISTRAL.parse(f"See {array} above.", {"get_time"}) == (f"See {array} above.", [])  # not at the end
    assert MISTRAL.content_before_calls("Let me check. [TOOL_CA") == len("Let me check.")
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[CLOCK], max_tokens=120,
                  extra_body={"structured_outputs": {"choice": [f"Let me check.[TOOL_CALLS]{array}"]}})
    with client_for(llm, tmp_path_factory, MISTRAL_TEMPLATE) as server, openai_client(server) as client:
        choice = client.chat.completions.create(**kwargs).choices[0]
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert choice.message.content == "Let me check." and choice.finish_reason == "tool_calls"  # before: all content
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert "".join(c.delta.content or "" for c in chunks) == "Let me check."
    assert [c.function.name for chunk in chunks for c in chunk.delta.tool_calls or []] == ["get_time"]


def test_mistral_streams_json_in_its_content_and_holds_back_only_an_array_of_calls(llm, tmp_path_factory):
    array = '[{"name": "get_time", "arguments": {"zone": "utc"}}]'
    assert MISTRAL.content_before_calls('Use [{"a": 1}] and') == len('Use [{"a": 1}] and')
    for held in ("[", "[{", '[{ "na', f"{array[:12]}"):  # what may still open an array of calls
        assert MISTRAL.content_before_calls(f"Sure. {held}") == len("Sure.")
    answer = 'Use this JSON: [{"a": 1}] and then I will explain the rest of the answer in some more detail here.'
    called = f"Let me check. {array}"

    def kwargs(text: str) -> dict:
        return dict(model=MODEL, messages=MESSAGES, tools=[CLOCK], max_tokens=120,
                    extra_body={"structured_outputs": {"choice": [text]}})
    with client_for(llm, tmp_path_factory, MISTRAL_TEMPLATE) as server, openai_client(server) as client:
        streamed = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs(answer)) if c.choices]
        choice = client.chat.completions.create(**kwargs(called)).choices[0]
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs(called)) if c.choices]
    contents = [c.delta.content for c in streamed if c.delta.content]
    assert "".join(contents) == answer and not any(c.delta.tool_calls for c in streamed)
    assert '[{"a": 1}] and then' in "".join(contents[:-1])  # before: all of it from "[{" on in the last chunk
    assert choice.message.content == "Let me check." and choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert "".join(c.delta.content or "" for c in chunks) == "Let me check."
    assert [c.function.name for chunk in chunks for c in chunk.delta.tool_calls or []] == ["get_time"]


@pytest.mark.parametrize("name", list(FIRST_OF_A_CALL))
def test_a_format_llguidance_does_not_know_is_left_unenforced_in_calls_as_in_response_format(llm, tmp_path_factory,
                                                                                             name):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[LOGIN], max_tokens=60, parallel_tool_calls=False, seed=1)
    with client_for(llm, tmp_path_factory, TEMPLATES[name]) as server, openai_client(server) as client:
        called = client.chat.completions.create(response_format=RESPONSE_FORMAT,  # before: a 400 dumping the grammar
                                                logit_bias=bias_to(llm, FIRST_OF_A_CALL[name]), **kwargs).choices[0]
        answered = client.chat.completions.create(response_format=RESPONSE_FORMAT, logit_bias=bias_to(llm, "{"),
                                                  **kwargs).choices[0]
        required = client.chat.completions.create(tool_choice="required", **kwargs).choices[0]
    for choice in (called, required):
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert_valid_call(choice.message.tool_calls[0], LOGIN)
    assert jsonschema_rs.validator_for(ANSWER).is_valid(json.loads(answered.message.content))


@dataclass(frozen=True)
class _NoCallsOfBad(ToolCallFormat):
    """Hermes' format, except that calls of a tool named "bad" make no grammar (whatever its parameters)."""

    def grammar(self, tools: list[dict], parallel: bool, answer: str | None = None) -> str:
        return "start: (" if any(t["name"] == "bad" for t in tools) else super().grammar(tools, parallel, answer)


@pytest.mark.parametrize("extra", [{"tool_choice": "required"}, {"response_format": RESPONSE_FORMAT}])
def test_a_tool_whose_calls_no_grammar_can_hold_is_a_400_naming_it_in_words(extra):
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object"}}}
    model = SimpleNamespace(name=MODEL, tool_call_format=_NoCallsOfBad(*astuple(HERMES)))
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [CLOCK, bad], **extra})
    tools = chat.ChatTools(model, request)
    with pytest.raises(APIError) as refused:
        tools.answer_or_calls(StructuredOutput(json=ANSWER)) if "response_format" in extra \
            else tools.structured_output()
    assert refused.value.param == "tools[1].function.parameters"  # its parameters compile alone; its calls do not
    assert "'bad'" in refused.value.message and "start:" not in refused.value.message


def test_parameters_that_compiled_are_not_compiled_again_nor_sent_to_a_worker_thread(monkeypatch):
    compiled, grammar_of = [], structured_output.grammar_of
    monkeypatch.setattr(structured_output, "grammar_of", lambda spec: compiled.append(spec) or grammar_of(spec))
    monkeypatch.setattr(chat, "_COMPILED_PARAMETERS", {})
    model = SimpleNamespace(name=MODEL, tool_call_format=tool_call_format(HERMES_TEMPLATE))

    def check(tools: list[dict]) -> None:
        request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": tools})
        asyncio.run(chat.check_tool_parameters(chat.ChatTools(model, request)))

    check([CLOCK, LOGIN])
    assert len(compiled) == 2

    def no_thread(*args, **kwargs):
        raise AssertionError("took a worker thread")

    monkeypatch.setattr(chat.asyncio, "to_thread", no_thread)
    check([LOGIN, CLOCK])  # an agent's next turn: before, each compiled again in a worker thread
    assert len(compiled) == 2
    monkeypatch.setattr(chat, "_MAX_COMPILED_PARAMETERS", 1)
    check([CLOCK])  # the one kept: the most recently sent
    with pytest.raises(AssertionError, match="worker thread"):  # one forgotten is compiled again, off the event loop
        check([LOGIN])


def test_a_call_cut_off_under_auto_beside_a_response_format_comes_back_as_a_call_not_markup():
    from kiln.runtime.structured_output import StructuredOutput
    from tests.test_server_allowed_tools import hermes_tools

    tools = hermes_tools()
    tools.answer_or_calls(StructuredOutput(json={"type": "object"}))
    content, calls = tools.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Os')]
    assert tools.parse('{"answer": 1}') == ('{"answer": 1}', [])  # the answer the format allows is content
