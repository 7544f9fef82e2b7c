"""Which tools may be called and how many calls come back: OpenAI's allowed_tools tool choice in chat's and the
Responses API's shapes (every tool rendered, only the listed ones called), the Responses API's max_tool_calls, and
tool errors of /v1/responses named by its flat tool fields."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest

from kiln.runtime.server.chat import ChatTools
from kiln.runtime.server.protocol import ChatCompletionRequest
from kiln.runtime.server.tool_calls import tool_call_format
from tests.test_server_tools import CLOCK, HERMES_TEMPLATE, MESSAGES, WEATHER, hermes_openai_client

MODEL = "tiny"
FLAT = {tool["function"]["name"]: {"type": "function", **tool["function"]} for tool in (WEATHER, CLOCK)}
ALLOW_CLOCK = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
    {"type": "function", "function": {"name": "get_time"}}]}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with hermes_openai_client(tmp_path_factory) as client:
        yield client


def hermes_tools(tool_choice: object = None, max_calls: int | None = None) -> ChatTools:
    model = SimpleNamespace(name=MODEL, tool_call_format=tool_call_format(HERMES_TEMPLATE))
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [WEATHER, CLOCK],
                                                    "tool_choice": tool_choice})
    return ChatTools(model, request, max_calls)


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>\n'


def test_allowed_tools_auto_reads_calls_of_the_listed_tools_only():
    weather, clock = call("get_weather", '{"city": "Oslo", "unit": "c"}'), call("get_time", '{"zone": "utc"}')
    allowed = hermes_tools({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}})
    assert [c.name for c in allowed.parse(clock)[1]] == ["get_time"]
    assert allowed.parse(weather) == (weather, [])  # another tool's call stays text
    assert [c.name for c in hermes_tools().parse(weather)[1]] == ["get_weather"]


def test_max_calls_keeps_the_first_calls_written():
    text = "".join(call("get_time", f'{{"zone": "{zone}"}}') for zone in ("utc", "cet", "utc"))
    assert [c.arguments for c in hermes_tools("required", 2).parse(text)[1]] == ['{"zone": "utc"}',
                                                                                  '{"zone": "cet"}']
    assert len(hermes_tools("auto", 2).parse(text)[1]) == 2 and len(hermes_tools("auto").parse(text)[1]) == 3


def test_chat_allowed_tools_required_calls_only_the_listed_tools_with_every_tool_rendered(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=120, seed=1)
    out = client.chat.completions.create(tool_choice=ALLOW_CLOCK, **kwargs)
    calls = out.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} == {"get_time"}
    plain = client.chat.completions.create(tool_choice="required", **kwargs)
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens  # the prompt renders both tools still


def test_responses_allowed_tools_required_calls_only_the_listed_tools_and_echoes_the_choice(client):
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    out = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=list(FLAT.values()),
                                  tool_choice=choice, max_output_tokens=120, temperature=0)
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and {c.name for c in calls} == {"get_time"}
    assert out.tool_choice.type == "allowed_tools" and out.tool_choice.mode == "required"


def test_an_allowed_tool_not_among_the_tools_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match="'nope', which is not among the tools") as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=4, tool_choice={
            "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
                {"type": "function", "function": {"name": "get_weather"}},
                {"type": "function", "function": {"name": "nope"}}]}})
    assert refused.value.param == "tool_choice.allowed_tools.tools[1]"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", tools=[FLAT["get_weather"]], tool_choice={
            "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]})
    assert refused.value.param == "tool_choice.tools[0]"
    with pytest.raises(openai.BadRequestError) as refused:  # named by the shape sent, not a named function's
        client.responses.create(model=MODEL, input="hi", tools=[FLAT["get_weather"]], tool_choice={
            "type": "allowed_tools", "mode": "any", "tools": [{"type": "function", "name": "get_weather"}]})
    assert refused.value.param == "tool_choice.mode"


def test_max_tool_calls_above_one_is_taken_and_bounds_the_calls(client):
    out = client.responses.create(model=MODEL, input="Time?", tools=[FLAT["get_time"]], tool_choice="required",
                                  max_tool_calls=2, max_output_tokens=200, temperature=0)
    assert 1 <= len([item for item in out.output if item.type == "function_call"]) <= 2
    assert out.max_tool_calls == 2


def test_a_responses_tool_whose_parameters_are_no_schema_is_named_by_its_flat_path(client):
    odd = {"type": "function", "name": "odd", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", tools=[FLAT["get_time"], odd])
    assert refused.value.param == "tools[1].parameters"  # before: the chat request's tools[1].function.parameters


def test_forcing_a_call_of_more_tools_than_a_grammar_holds_is_refused_at_once_naming_allowed_tools(
        monkeypatch):
    from kiln.runtime.server.errors import APIError

    model = SimpleNamespace(name=MODEL, tool_call_format=tool_call_format(HERMES_TEMPLATE))
    tools = [{"type": "function", "function": {"name": f"tool{i}", "parameters": {"type": "object", "properties": {
        f"argument{j}": {"type": "string"} for j in range(20)}}}} for i in range(300)]  # ~180 KB of calls
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": tools, "tool_choice": "required"})
    forced = ChatTools(model, request)
    compiled = []
    real = forced._compiled
    monkeypatch.setattr(forced, "_compiled", lambda *args: compiled.append(1) or real(*args))
    with pytest.raises(APIError, match="calls of 300 tools are too large a grammar .*allowed_tools") as refused:
        forced.structured_output()
    assert refused.value.param == "tools" and len(compiled) == 1  # before: each tool's grammar compiled, seconds


def test_a_call_nested_deeper_or_with_longer_numbers_than_python_reads_stays_text():
    for unreadable in ('{"a":' * 5000 + "1" + "}" * 5000, '{"a": ' + "1" * 5000 + "}"):
        text = call("get_weather", unreadable)
        assert hermes_tools().parse(text) == (text, [])  # before: RecursionError / ValueError, a 500
