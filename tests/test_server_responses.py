"""OpenAI's Responses API (/v1/responses) through the official openai client: text answers equal the chat
endpoint's, streamed as typed events the client's stream helper assembles, function tools called and their outputs
passed back, JSON output held to its schema, and what a stateless server cannot do refused by name."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import openai
import pytest

from kiln.runtime import LLM
from tests.test_server_support import tiny_engine
from tests.test_server_tools import HERMES_TEMPLATE, WEATHER, client_for

MODEL = "tiny"
QUESTION = "Tell me about kilns."
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool


@pytest.fixture(scope="module")
def client(llm, tmp_path_factory):
    with client_for(llm, tmp_path_factory, HERMES_TEMPLATE) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def llm():
    with LLM.load(tiny_engine(max_seq_len=1024, max_input_len=896)) as llm:
        yield llm


def test_a_text_answer_is_the_chat_endpoints_with_usage_and_an_incomplete_status_at_the_token_limit(client):
    out = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=6,
                                  temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    assert out.id.startswith("resp_") and out.object == "response" and out.model == MODEL
    assert out.output_text == chat.choices[0].message.content
    assert [item.type for item in out.output] == ["message"] and out.output[0].role == "assistant"
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.instructions == "Be brief." and out.max_output_tokens == 6


def test_a_streamed_answer_is_typed_events_in_order_that_add_up_to_the_whole_answer(client):
    kwargs = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                  max_output_tokens=5, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == \
        whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 5
    with client.responses.stream(**kwargs) as stream:  # the client's helper assembles the same snapshot
        assert [event.type for event in stream] == kinds


def test_function_tools_are_called_and_their_outputs_passed_back_as_items(client):
    out = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[FLAT_WEATHER],
                                  tool_choice="required", max_output_tokens=120, temperature=0)
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and out.status == "completed"
    schema = jsonschema_rs.validator_for(WEATHER["function"]["parameters"])
    for call in calls:
        assert call.name == "get_weather" and schema.is_valid(json.loads(call.arguments))
    follow_up = [{"role": "user", "content": "Weather in Oslo?"},
                 *[call.model_dump() for call in calls],  # as the client dumps them: its extra fields, nulls
                 *[{"type": "function_call_output", "call_id": call.call_id, "output": "12 C, rain"}
                   for call in calls]]
    searched = {**FLAT_WEATHER, "defer_loading": False, "allowed_callers": ["direct"], "output_schema": None}
    answer = client.responses.with_raw_response.create(  # the current SDK's tool fields, which change nothing here
        model=MODEL, input=follow_up, tools=[searched], max_output_tokens=4, temperature=0)
    assert answer.headers["kiln-ignored-fields"] == "tools[].allowed_callers"
    answer = answer.parse()
    assert answer.usage.input_tokens > out.usage.input_tokens  # the calls and their outputs were rendered
    streamed = list(client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[FLAT_WEATHER],
                                            tool_choice="required", max_output_tokens=120, temperature=0,
                                            stream=True))
    done = [event.item for event in streamed if event.type == "response.output_item.done"]
    assert [(item.name, item.arguments) for item in done] == [(call.name, call.arguments) for call in calls]


def test_an_answer_passed_back_as_the_clients_dump_of_its_output_items_is_taken(client):
    first = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0, top_logprobs=1,
                                    include=["message.output_text.logprobs"])
    [answer] = [item.model_dump() for item in first.output]  # every key the client's output types carry
    assert {"id", "status", "phase"} <= answer.keys() and {"annotations", "logprobs"} <= answer["content"][0].keys()
    again = [{"role": "user", "content": QUESTION}, answer, {"role": "user", "content": "More."}]
    as_text = [*again[:1], {"role": "assistant", "content": first.output_text}, *again[2:]]
    usage = [client.responses.create(model=MODEL, input=items, max_output_tokens=1).usage for items in (again, as_text)]
    assert usage[0].input_tokens == usage[1].input_tokens


def test_a_call_the_token_limit_cut_off_is_an_incomplete_item_whole_and_streamed(client):
    request = dict(model=MODEL, input="Weather in Oslo?", tools=[FLAT_WEATHER], tool_choice="required",
                   max_output_tokens=40, temperature=0)  # the tiny model's call is cut off inside its arguments
    whole = client.responses.create(**request)
    streamed = [event.response for event in client.responses.create(**request, stream=True)
                if event.type == "response.incomplete"]
    for response in (whole, *streamed):
        [call] = response.output
        assert response.status == "incomplete" and call.status == "incomplete" and call.arguments.startswith("{")


def test_a_json_schema_text_format_holds_the_answer_to_its_schema(client):
    schema = {"type": "object", "properties": {"kiln": {"type": "string", "maxLength": 8}}, "required": ["kiln"],
              "additionalProperties": False}
    out = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=60, temperature=0, text={
        "format": {"type": "json_schema", "name": "kiln", "schema": schema, "strict": True}})
    assert jsonschema_rs.validator_for(schema).is_valid(json.loads(out.output_text))


@pytest.mark.parametrize(("extra", "field"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "msg_1"}]}, "input[1]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": "hi", "phase": 1}]}, "input[0].phase"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),  # the chat path's check, in this request's terms
    ({"input": {"a": 1}}, "input"),  # neither member of the union: named as the field, not as pydantic's member
    ({"input": ["hi"]}, "input[0]"),
])
def test_what_a_stateless_text_server_cannot_do_is_a_400_naming_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": MODEL, "input": QUESTION, **extra})
    assert refused.value.param == field and "input.str" not in refused.value.message
    assert "_item_tag" not in refused.value.message
    assert "max_completion_tokens" not in refused.value.message and "messages" not in refused.value.message


def test_a_length_check_names_max_output_tokens_as_the_client_sent_it(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, extra_body={"min_tokens": 5})
    assert refused.value.param == "min_tokens" and "max_output_tokens=3" in refused.value.message


def test_a_failure_mid_stream_is_an_error_event_then_the_response_failed(client):
    events = list(client.responses.create(model=MODEL, input=QUESTION, stream=True, text={
        "format": {"type": "json_schema", "name": "none", "schema": {"$ref": "#"}}}))
    assert [event.type for event in events] == ["response.created", "response.in_progress", "error",
                                                "response.failed"]  # before: no response.failed, OpenAI's last
    error, failed = events[2:]
    assert "structured output format cannot go on" in error.message and error.param == "text.format"
    assert [error.sequence_number, failed.sequence_number] == [2, 3]
    assert failed.response.status == "failed" and failed.response.error.code == "invalid_prompt"
    assert failed.response.id == events[0].response.id


def assert_same_logprobs(entries: list, expected: list, with_bytes: bool = True) -> None:
    """The same tokens (and ``bytes``, ``with_bytes``) and alternatives, their log probabilities within 1e-4 (a
    prefix-cache hit computes them apart)."""
    def tokens(items: list) -> list[tuple]:
        return [(entry.token, entry.bytes if with_bytes else None, [top.token for top in entry.top_logprobs])
                for entry in items]

    def values(items: list) -> list[float]:
        return [v for entry in items for v in (entry.logprob, *(top.logprob for top in entry.top_logprobs))]

    assert tokens(entries) == tokens(expected)
    assert values(entries) == pytest.approx(values(expected), abs=1e-4)


def test_output_logprobs_are_included_as_the_chat_endpoint_reports_them_whole_and_streamed(client):
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"])
    whole = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": QUESTION}])
    expected = chat.choices[0].logprobs.content
    assert_same_logprobs(whole.output[0].content[0].logprobs, expected)
    assert all(len(entry.top_logprobs) == 2 for entry in expected)
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    done = next(event for event in events if event.type == "response.output_text.done")
    assert [entry.token for entry in streamed] == [entry.token for entry in expected]
    assert_same_logprobs(done.logprobs, expected, with_bytes=False)  # the event's type has no bytes
    part = next(event for event in events if event.type == "response.content_part.done").part
    assert_same_logprobs(part.logprobs, expected)  # the text part's, bytes and all (ResponseOutputText's)
    assert not any(entry.model_extra or any(top.model_extra for top in entry.top_logprobs)
                   for entry in [*streamed, *done.logprobs])  # before: bytes, which the events' types lack
    plain = client.responses.create(**{**kwargs, "include": None})
    assert plain.output[0].content[0].logprobs == []
    stopped = {**kwargs, "extra_body": {"stop": [whole.output_text[:2]]}}  # the stop string's tokens add no text
    events = list(client.responses.create(stream=True, **stopped))
    streamed = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    done = next(event for event in events if event.type == "response.output_text.done")
    assert streamed and [entry.token for entry in streamed] == [entry.token for entry in done.logprobs]  # before:
    # the deltas left them out


def test_an_include_this_server_cannot_fill_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=QUESTION, include=["file_search_call.results"])
    assert refused.value.param == "include[0]"


def test_vllms_sampling_extensions_reach_the_answer_as_in_chat(client):
    out = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20, extra_body={
        "structured_outputs": {"choice": ["Oslo.", "Bergen."]}, "seed": 3, "top_k": 5, "stop": ["zz"]})
    assert out.output_text in ("Oslo.", "Bergen.")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=QUESTION, extra_body={"top_k": -2})
    assert refused.value.param == "top_k"


def test_the_response_echoes_the_requests_settings_and_its_usage_validates_as_the_client_types_it(client):
    from openai.types.responses import Response

    settings = dict(max_tool_calls=1, parallel_tool_calls=True, reasoning={"effort": "low"}, top_logprobs=2,
                    user="u", service_tier="auto", prompt_cache_key="k", truncation="auto")
    first = client.responses.create(model=MODEL, input=QUESTION * 8, max_output_tokens=2, **settings)
    again = client.responses.with_raw_response.create(model=MODEL, input=QUESTION * 8, max_output_tokens=2, **settings)
    out = Response.model_validate(again.http_response.json())  # strict: every field the client requires is there
    assert (out.max_tool_calls, out.parallel_tool_calls, out.reasoning.effort, out.top_logprobs, out.user,
            out.service_tier, out.prompt_cache_key, out.truncation) == (1, True, "low", 2, "u", "auto", "k", "auto")
    assert first.usage.input_tokens_details.cached_tokens < out.usage.input_tokens_details.cached_tokens
    with pytest.raises(openai.BadRequestError, match="json_schema format needs schema") as refused:
        client.responses.create(model=MODEL, input=QUESTION, text={"format": {"type": "json_schema", "name": "x"}})
    assert refused.value.param == "text.format"
    with pytest.raises(openai.BadRequestError, match='only read with type "json_schema", not "json_object"'):
        client.responses.create(model=MODEL, input=QUESTION, text={"format": {"type": "json_object",
                                                                              "schema": {"type": "integer"}}})


def test_the_sdks_prompt_cache_options_are_taken_and_named_as_ignored_and_moderation_only_at_null(client):
    raw = client.responses.with_raw_response.create(  # fields of the current SDK's request type, as chat takes them
        model=MODEL, input=QUESTION, max_output_tokens=1, moderation=None, prompt_cache_retention="24h",
        prompt_cache_options={"mode": "explicit", "ttl": "12h", "prewarm": False, "comparison_response_id": "r"})
    assert raw.headers["kiln-ignored-fields"] == "prompt_cache_options, prompt_cache_retention"
    for sent, field in (({"prompt_cache_options": {"ttl": "banana"}}, "prompt_cache_options.ttl"),
                        ({"prompt_cache_options": {"prewarm": True}}, "prompt_cache_options.prewarm"),
                        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1, **sent)
        assert refused.value.param == field


def test_vllms_request_id_names_the_response_and_the_request(client):
    raw = client.responses.with_raw_response.create(model=MODEL, input=QUESTION, max_output_tokens=1,
                                                    extra_body={"request_id": "job-3"})
    assert raw.parse().id == "resp_job-3" and raw.headers["x-request-id"] == "job-3"  # it had been a 400


def test_streamed_events_are_raw_utf8_as_the_whole_response_and_a_lone_surrogate_stays_an_escape(client):
    body = b'{"model": "tiny", "input": "hi", "instructions": "\xe6\x9c\xac", "max_output_tokens": 2, ' \
           b'"metadata": {"k": "\\ud800"}'  # a lone surrogate: JSON can carry it as an escape, UTF-8 cannot
    for end in (b"}", b', "stream": true}'):
        answer = httpx.post(f"{client.base_url}responses", content=body + end,
                            headers={"Content-Type": "application/json"}, timeout=30)
        assert answer.status_code == 200  # before: a 500 whole, as no UTF-8 can carry the surrogate
        assert '"instructions":"本"'.encode() in answer.content  # before: "\\u672c" in the stream
        echoed = json.loads(answer.content.decode().split("data: ", 1)[-1].split("\n", 1)[0])
        assert echoed.get("response", echoed)["metadata"] == {"k": "\ud800"}


def test_every_sampling_extension_passes_to_the_chat_request_as_a_client_sent_it():
    from kiln.runtime.server.responses import chat_request
    from kiln.runtime.server.responses_protocol import ResponsesRequest

    request = ResponsesRequest.model_validate({"model": MODEL, "input": QUESTION, "logit_bias": {"5": 10},
                                               "structured_outputs": {"json": {"type": "object"}}})
    chat = chat_request(request)
    assert chat.logit_bias == {5: 10.0} and chat.structured_outputs.json_schema == {"type": "object"}
