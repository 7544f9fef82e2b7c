"""Keys a Responses input item or its parts carry that Kiln does not know are taken as vLLM takes them (never
rendered) and named in Kiln-Ignored-Fields as ``input[].KEY`` and ``input[].content[].KEY``, logged once each under
the bound message keys share; their known fields keep their types, and an unknown request field is still a 400."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest

from kiln.runtime.server.jobs import MAX_LOGGED_MESSAGE_KEYS, log_ignored_fields
from tests.test_server_ignored_options import named
from tests.test_server_tools import hermes_openai_client

MODEL = "tiny"
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}


def passed_back(extra: dict, part_extra: dict) -> list[dict]:
    """A second turn as an agent SDK passes the first's output back: each item and part with ``extra`` keys."""
    return [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?", **part_extra}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}], **extra},
            {**CALL, **extra},
            {"type": "function_call_output", "call_id": "call_1", "output": "Rain.", **extra}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with hermes_openai_client(tmp_path_factory) as client:
        yield client


def test_unknown_keys_of_input_items_and_parts_are_named_once_each_logged_once_and_never_rendered(client, caplog):
    caplog.set_level("WARNING", logger="kiln.server")
    litellm = passed_back({"provider_specific_fields": None}, {"cache_control": {"type": "ephemeral"}})
    for _ in range(2):
        raw = client.responses.with_raw_response.create(model=MODEL, input=litellm, max_output_tokens=1)
        assert named(raw) == {"input[].provider_specific_fields", "input[].content[].cache_control"}  # before: a 400
    plain = client.responses.create(model=MODEL, input=passed_back({}, {}), max_output_tokens=1)
    assert raw.parse().usage.input_tokens == plain.usage.input_tokens
    assert [r.getMessage() for r in caplog.records].count(
        "requests set 'input[].content[].cache_control', which this server accepts and ignores (logged once)") == 1


@pytest.mark.parametrize(("items", "field"), [
    ([{**CALL, "call_id": 5}], "input[0].call_id"),
    ([{"role": "user", "content": [{"type": "input_text", "text": 1, "cache_control": {}}]}],
     "input[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "input_text", "content": "What?"}]}], "input[0].content[0]"),  # no text:
    ([{"role": "user", "content": [{"type": "refusal", "text": "No."}]}], "input[0].content[0]"),  # before, a 200
])
def test_known_fields_of_an_input_item_keep_their_types(client, items, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=items, max_output_tokens=1)
    assert refused.value.param == field


def test_an_unknown_request_field_is_still_a_400_with_its_advice(client):
    with pytest.raises(openai.BadRequestError, match="send max_output_tokens instead") as refused:
        client.responses.create(model=MODEL, input=passed_back({"status": "completed", "x": 1}, {}),
                                extra_body={"max_tokens": 1})
    assert refused.value.param == "max_tokens"


def test_input_item_keys_count_under_the_bound_message_keys_share(caplog):
    model = SimpleNamespace(logged_ignored_fields=set())
    caplog.set_level("WARNING", logger="kiln.server")
    log_ignored_fields(model, [f"messages[].key{i}" for i in range(MAX_LOGGED_MESSAGE_KEYS)])
    log_ignored_fields(model, ["input[].status", "store"])
    assert len(caplog.records) == MAX_LOGGED_MESSAGE_KEYS + 1 and "'store'" in caplog.records[-1].getMessage()
