"""Kiln-Ignored-Fields names every option a request sets that changes nothing, down to the sub-field (reasoning's
summary, an include entry, stream options no stream here honours), and leaves out what Kiln does anyway (store
false); /v1/responses refuses stream_options without stream as the other routes do."""

from __future__ import annotations

import openai
import pytest

from tests.test_server_tools import MESSAGES, hermes_openai_client

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with hermes_openai_client(tmp_path_factory) as client:
        yield client


def named(response) -> set[str]:
    return set(filter(None, response.headers.get("kiln-ignored-fields", "").split(", ")))


def test_responses_name_reasoning_sub_fields_and_an_include_they_do_not_honour(client):
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="hi", max_output_tokens=2, reasoning={"effort": "low", "summary": "detailed"},
        include=["reasoning.encrypted_content"], store=False)
    assert {"reasoning.summary", "include.reasoning.encrypted_content"} <= named(raw)  # before: neither
    assert "store" not in named(raw) and raw.parse().store is False  # nothing stored: what false asks
    stored = client.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=2, store=True)
    assert named(stored) == {"store"}


def test_responses_stream_options_need_a_stream_and_obfuscation_is_named(client):
    with pytest.raises(openai.BadRequestError, match="only allowed with stream: true") as refused:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                stream_options={"include_obfuscation": False})
    assert refused.value.param == "stream_options"
    with client.responses.with_streaming_response.create(model=MODEL, input="hi", max_output_tokens=2, stream=True,
                                                         stream_options={"include_obfuscation": True}) as stream:
        assert named(stream) == {"stream_options.include_obfuscation"}


@pytest.mark.parametrize(("options", "ignored"), [
    ({"continuous_usage_stats": True}, {"stream_options.continuous_usage_stats"}),  # no usage to send
    ({"include_usage": True, "continuous_usage_stats": True}, set()),
    ({"include_obfuscation": True}, {"stream_options.include_obfuscation"}),
    ({"include_obfuscation": False}, set()),
])
def test_stream_options_that_change_nothing_are_named_on_completions_and_chat(client, options, ignored):
    with client.completions.with_streaming_response.create(model=MODEL, prompt="a", max_tokens=2, stream=True,
                                                           stream_options=options) as stream:
        assert named(stream) == ignored
    with client.chat.completions.with_streaming_response.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                                stream=True, stream_options=options) as stream:
        assert named(stream) == ignored


def test_chat_names_store_only_when_true(client):
    for store, ignored in ((False, set()), (True, {"store"})):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                               store=store)
        assert named(raw) == ignored


def test_a_litellm_second_turn_is_answered_and_the_message_keys_it_adds_are_named_not_rendered(client, caplog):
    def turn(answer: dict) -> list[dict]:
        return [*MESSAGES, answer, {"role": "user", "content": "And tomorrow?"}]

    plain = {"role": "assistant", "content": "Rain."}
    litellm = {**plain, "tool_calls": None, "function_call": None,  # LiteLLM's answer as it appends it to messages
               "provider_specific_fields": {"reasoning": None}, "thinking_blocks": None}
    caplog.set_level("WARNING", logger="kiln.server")
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=turn(litellm), max_tokens=2)
        assert named(raw) == {"messages[].provider_specific_fields", "messages[].thinking_blocks"}  # before: a 400
    alone = client.chat.completions.create(model=MODEL, messages=turn(plain), max_tokens=2)
    assert raw.parse().usage.prompt_tokens == alone.usage.prompt_tokens  # the template never saw them
    assert [r.getMessage() for r in caplog.records].count(
        "requests set 'messages[].thinking_blocks', which this server accepts and ignores (logged once)") == 1


def test_message_keys_are_logged_once_each_up_to_a_bound_as_clients_choose_them_and_fields_always(caplog):
    from types import SimpleNamespace

    from kiln.runtime.server.jobs import MAX_LOGGED_MESSAGE_KEYS, make_jobs

    model = SimpleNamespace(logged_ignored_fields=set(), sampling_defaults=None)
    keys = [f"messages[].key{i}" for i in range(MAX_LOGGED_MESSAGE_KEYS + 9)]
    caplog.set_level("WARNING", logger="kiln.server")
    for names in (keys, keys, [*keys, "user"]):
        make_jobs(model, SimpleNamespace(ignored_fields=lambda names=names: names, n=1), [], [], logprobs=None,
                  prompt_logprobs=None, structured_output=None)
    assert len(caplog.records) == MAX_LOGGED_MESSAGE_KEYS + 1 and "'user'" in caplog.records[-1].getMessage()
