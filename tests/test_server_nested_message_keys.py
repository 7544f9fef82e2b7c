"""Keys a chat message's tool calls, their functions and its content parts carry that Kiln does not know are taken
as vLLM takes them (never given to the template) and named in Kiln-Ignored-Fields as ``messages[].tool_calls[].KEY``,
``messages[].tool_calls[].function.KEY`` and ``messages[].content[].KEY``; their known fields keep their types."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest

from kiln.runtime.chat_template import ChatTemplate
from kiln.runtime.server.chat import render_chat
from kiln.runtime.server.jobs import log_ignored_fields
from kiln.runtime.server.protocol import ChatCompletionRequest
from tests.test_server_ignored_options import named
from tests.test_server_tools import hermes_openai_client

MODEL = "tiny"
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
LITELLM_CALL = {**CALL, "function": {**CALL["function"], "provider_specific_fields": None},
                "provider_specific_fields": {}}


def conversation(call: dict, part_keys: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?", **part_keys}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Rain."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with hermes_openai_client(tmp_path_factory) as client:
        yield client


def test_unknown_keys_of_tool_calls_and_content_parts_are_named_once_each_and_logged_once(client, caplog):
    cached = {"cache_control": {"type": "ephemeral"}}  # LiteLLM's Anthropic-style prompt caching
    caplog.set_level("WARNING", logger="kiln.server")
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=conversation(LITELLM_CALL, cached), max_tokens=2)
        assert named(raw) == {"messages[].tool_calls[].provider_specific_fields",  # before: a 400
                              "messages[].tool_calls[].function.provider_specific_fields",
                              "messages[].content[].cache_control"}  # before: dropped unnamed
    plain = client.chat.completions.create(model=MODEL, messages=conversation(CALL, {}), max_tokens=2)
    assert raw.parse().usage.prompt_tokens == plain.usage.prompt_tokens
    assert [r.getMessage() for r in caplog.records].count(
        "requests set 'messages[].content[].cache_control', which this server accepts and ignores (logged once)") == 1


@pytest.mark.parametrize(("call", "field"), [({**CALL, "id": 5}, "id"),
                                             ({**CALL, "function": {**CALL["function"], "name": 1}}, "name")])
def test_known_fields_of_a_tool_call_keep_their_types(client, call, field):
    with pytest.raises(openai.BadRequestError, match=field):
        client.chat.completions.create(model=MODEL, messages=conversation(call, {}), max_tokens=2)


def test_the_template_never_gets_the_unknown_keys_of_a_tool_call():
    req = ChatCompletionRequest.model_validate({"messages": conversation(LITELLM_CALL, {"cache_control": {}})})
    model = SimpleNamespace(chat_template=ChatTemplate("{{ messages | tojson }}", {}))
    rendered = json.loads(render_chat(model, req.messages, None, add_generation_prompt=False))
    assert rendered[1]["tool_calls"] == [{**CALL, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert "cache_control" not in json.dumps(rendered)


def test_unknown_keys_too_long_or_odd_to_log_are_counted_once_not_named(caplog):
    model = SimpleNamespace(logged_ignored_fields=set())
    caplog.set_level("WARNING", logger="kiln.server")
    odd = ["messages[]." + "K" * 9000, "messages[].bad\nkey\x1b[31m"]
    for _ in range(2):
        log_ignored_fields(model, [*odd, "messages[].cache_control"])
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "'messages[].cache_control'" in messages[0]  # before: 9,163 characters, "\x1b"
    assert messages[1].startswith("requests set 2 other unknown keys whose names are not shown")
    assert "K" * 101 not in str(model.logged_ignored_fields) and len(model.logged_ignored_fields) == 3
