"""A stop string or stop_token_ids id that ends a forced call's output inside the call (its grammar not complete)
leaves that call text, as any call that does not parse: content, no tool_calls for it, finish_reason "stop" with
the stop_reason, in chat (whole and streamed, and through the SDK's parse helper) and in the Responses API; a call
cut off by the token limit still comes back as far as it got."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

import openai
import pydantic
import pytest

from kiln.runtime.outputs import StreamDelta
from kiln.runtime.server.chat import ChatTools
from kiln.runtime.server.protocol import ChatCompletionRequest
from kiln.runtime.server.responses import _StreamedResponse
from kiln.runtime.server.tool_calls import HERMES, LLAMA3_JSON, MISTRAL
from tests.test_server_tools import CLOCK, HERMES_TEMPLATE, MESSAGES, MODEL, WEATHER, client_for, llm  # noqa: F401

NAMED = {"type": "function", "function": {"name": "get_time"}}
# the grammar writes the compact call '<tool_call>\n{"name":"get_time","arguments":{"zone":...}}': the key is forced
CUT = '<tool_call>\n{"name":"get_time","arguments":{'
STOP = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=60, seed=3, stop=['"zone"'])


class Clock(pydantic.BaseModel):
    zone: Literal["utc", "cet"]


@pytest.fixture(scope="module")
def client(llm, tmp_path_factory):  # noqa: F811
    with client_for(llm, tmp_path_factory, HERMES_TEMPLATE) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        yield client


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_a_stop_string_inside_a_forced_call_leaves_it_text_whole_and_streamed(client, tool_choice):
    choice = client.chat.completions.create(tool_choice=tool_choice, **STOP).choices[0]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", '"zone"')
    assert choice.message.tool_calls is None and choice.message.content == CUT
    chunks = [c.choices[0] for c in client.chat.completions.create(tool_choice=tool_choice, stream=True, **STOP)
              if c.choices]
    assert not [c for c in chunks if c.delta.tool_calls]  # the cut call never went out as a call
    assert "".join(c.delta.content or "" for c in chunks) == CUT
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]


def test_the_sdks_parse_helper_takes_a_forced_call_a_stop_string_cut(client):
    kwargs = {**STOP, "tools": [openai.pydantic_function_tool(Clock)]}
    choice = client.chat.completions.parse(tool_choice="required", **kwargs).choices[0]  # raised ValidationError
    assert choice.finish_reason == "stop" and choice.message.tool_calls in (None, [])
    assert choice.message.content == CUT.replace("get_time", "Clock")


def test_a_stop_token_id_inside_a_forced_call_leaves_it_text(client, llm):  # noqa: F811
    kwargs = {**STOP, "stop": None, "tool_choice": NAMED}
    whole = client.chat.completions.create(logprobs=True, extra_body={"return_tokens_as_token_ids": True}, **kwargs)
    ids = [int(entry.token.removeprefix("token_id:")) for entry in whole.choices[0].logprobs.content]
    texts = [llm.tokenizer.decode(ids[:end]) for end in range(len(ids) + 1)]
    at = next(i for i, text in enumerate(texts) if '"arguments":{"' in text and ids[i] not in ids[:i])  # inside
    cut = client.chat.completions.create(extra_body={"stop_token_ids": [ids[at]]}, **kwargs).choices[0]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", ids[at])
    assert cut.message.tool_calls is None and cut.message.content == texts[at]


def test_the_responses_api_gives_a_cut_call_as_a_completed_message_whole_and_streamed(client):
    kwargs = dict(model=MODEL, input="Weather in Oslo?", tool_choice="required", max_output_tokens=60,
                  tools=[{"type": "function", **CLOCK["function"]}], extra_body={"stop": ['"zone"']})
    out = client.responses.create(**kwargs)
    assert out.status == "completed" and [item.type for item in out.output] == ["message"]
    assert out.output[0].status == "completed" and out.output_text == CUT
    events = list(client.responses.create(stream=True, **kwargs))
    assert not [e for e in events if e.type.startswith("response.function_call")]
    assert events[-1].type == "response.completed" and events[-1].response.output_text == CUT


def hermes_tools(tool_choice: object) -> ChatTools:
    model = SimpleNamespace(name=MODEL, tool_call_format=HERMES)
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [WEATHER, CLOCK],
                                                    "tool_choice": tool_choice})
    return ChatTools(model, request)


def test_whole_calls_before_the_cut_one_stay_calls_and_the_token_limit_keeps_the_cut_one_a_call():
    whole = '<tool_call>\n{"name":"get_time","arguments":{"zone":"utc"}}\n</tool_call>'
    text, required = f'{whole}\n{CUT}"zone":"c', hermes_tools("required")
    content, calls = required.parse(text, stopped=True)
    assert (content, [c.name for c in calls]) == (f'{CUT}"zone":"c', ["get_time"])
    assert required.finish_reason(calls, "stop", content) == "stop"
    content, calls = required.parse(text)  # the token limit cut it: as far as it got, as OpenAI returns it
    assert content is None and [(c.arguments, c.cut_off) for c in calls] == [('{"zone": "utc"}', False),
                                                                            ('{"zone":"c', True)]
    named = hermes_tools(NAMED)
    for ended in (whole, whole.removesuffix("_call>")):  # the grammar ended it, or a stop string in its closing tag
        content, calls = named.parse(ended, stopped=True)
        assert (content, [c.arguments for c in calls]) == (None, ['{"zone": "utc"}'])
        assert named.finish_reason(calls, "stop", content) == "stop"
    assert required.finish_reason(calls, "stop", None) == "tool_calls"


def test_the_text_of_the_cut_call_is_found_in_every_format():
    assert LLAMA3_JSON.unfinished_call('{"name":"a","parameters":{"x":', {"a"}) == '{"name":"a","parameters":{"x":'
    assert LLAMA3_JSON.unfinished_call('{"name":"a","parameters":{}}', {"a"}) == ""
    two = '[{"name":"a","arguments":{}},{"name":"a","arguments":{"x'
    assert MISTRAL.unfinished_call(two, {"a"}) == '{"name":"a","arguments":{"x'
    assert MISTRAL.unfinished_call('[{"name":"a","arguments":{}}', {"a"}) == ""  # a stop string at "]"


def test_the_responses_stream_lists_the_calls_before_the_text_of_the_call_a_stop_cut_after_them():
    whole = '<tool_call>\n{"name":"get_time","arguments":{"zone":"utc"}}\n</tool_call>'
    stream = _StreamedResponse(hermes_tools("required"), None, None, "msg_1", None)
    delta = StreamDelta("r", f'{whole}\n{CUT}"zone":"c', [], finished=True, finish_reason="stop")
    events = stream.render(0, delta)
    assert [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.done"] \
        == [(0, "function_call"), (1, "message")]  # in the order the model wrote them, as OpenAI lists them
    assert {e["output_index"] for e in events if e["type"].startswith("response.output_text")} == {1}
    assert [item["type"] for item in stream.output] == ["function_call", "message"]
