"""A reasoning parser (vLLM's --reasoning-parser qwen3 / deepseek_r1) sends a model's <think> text as
message.reasoning and reasoning_content, apart from its answer, whole and streamed, whether the model opens the thought
or the prompt does; tool calls are read from the answer."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from kiln.runtime import LLM
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from kiln.runtime.server.reasoning import ReasoningSplitter, split_reasoning, thinking_at_start
from tests.test_server_support import tiny_engine

MODEL = "tiny"
# a trimmed Qwen3 template: <think> closed empty without thinking; think_in_prompt opens it, as R1's templates do
TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools> Call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif think_in_prompt %}<think>
{% endif %}{% endif %}"""
MESSAGES = [{"role": "user", "content": "Capital of Norway?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize(("text", "thinking", "reasoning", "answer"), [
    ("<think>\nNorway... Oslo.\n</think>\n\nOslo.", False, "\nNorway... Oslo.\n", "Oslo."),  # the model opens it
    ("Norway... Oslo.\n</think>\n\nOslo.", True, "Norway... Oslo.\n", "Oslo."),  # the prompt opened it
    ("Oslo, not <think>", False, None, "Oslo, not <think>"),  # thinking off: a later tag is text
    ("  <think>Norway is", False, "Norway is", ""),  # cut off while thinking: all reasoning
    ("<thin", False, None, "<thin"),  # ended on what only looked like a tag
    ("<think>\nhmm</think>Oslo.", True, "\nhmm", "Oslo."),  # the prompt opened it, and the model wrote it again
])
def test_a_completion_splits_the_same_whole_and_streamed_a_character_at_a_time(text, thinking, reasoning, answer):
    assert split_reasoning(text, thinking) == (reasoning, answer, "</think>" in text or reasoning is None)
    splitter = ReasoningSplitter(thinking)
    pieces = [splitter.feed(character, i == len(text) - 1) for i, character in enumerate(text)]
    assert "".join(r for r, _ in pieces) == (reasoning or "") and "".join(a for _, a in pieces) == answer


@pytest.mark.parametrize(("generation_prompt", "qwen3", "deepseek_r1"), [
    ("<|im_start|>assistant\n", False, True),  # no thought named: R1 may think without writing <think>
    ("<|im_start|>assistant\n<think>\n", True, True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False, False),  # thinking turned off
])
def test_where_the_thought_starts_is_read_from_the_generation_prompt_as_each_parser_reads_it(generation_prompt,
                                                                                             qwen3, deepseek_r1):
    assert (thinking_at_start(generation_prompt, "qwen3"),
            thinking_at_start(generation_prompt, "deepseek_r1")) == (qwen3, deepseek_r1)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    engine = tmp_path_factory.mktemp("engine") / "engine"
    shutil.copytree(tiny_engine(max_seq_len=512, max_input_len=384), engine)
    (engine / "chat_template.jinja").write_text(TEMPLATE)
    settings = ServerSettings(model_name=MODEL, reasoning_parser="qwen3")
    with LLM.load(engine) as llm, ServerThread(create_app(llm, engine, settings)) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        yield client


def ask(client, written: str, stream: bool = False, **kwargs):
    """A chat completion whose text is ``written`` (the only string its structured output allows)."""
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, stream=stream,
                                          extra_body={"structured_outputs": {"choice": [written]},
                                                      **kwargs.pop("extra_body", {})}, **kwargs)


def streamed_fields(chunks) -> tuple[str, str]:
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    return "".join(getattr(d, "reasoning", None) or "" for d in deltas), "".join(d.content or "" for d in deltas)


def test_the_thought_comes_apart_from_the_answer_whole_and_streamed(client):
    written = "<think>\nNorway's capital.\n</think>\n\nOslo."
    message = ask(client, written).choices[0].message
    thought = "\nNorway's capital.\n"
    assert (message.reasoning, message.reasoning_content, message.content) == (thought, thought, "Oslo.")
    chunks = list(ask(client, written, stream=True))
    assert streamed_fields(chunks) == ("\nNorway's capital.\n", "Oslo.")
    deltas = [d for chunk in chunks if chunk.choices and getattr(d := chunk.choices[0].delta, "reasoning", None)]
    assert all(d.reasoning == d.reasoning_content for d in deltas) and len(deltas) > 1  # sent as it comes


def test_include_reasoning_false_leaves_the_thought_out_as_vllm_does(client):
    written = "<think>\nNorway's capital.\n</think>\n\nOslo."
    left_out = {"extra_body": {"include_reasoning": False}}
    message = ask(client, written, **left_out).choices[0].message
    assert (getattr(message, "reasoning", None), message.content) == (None, "Oslo.")
    assert streamed_fields(ask(client, written, stream=True, **left_out)) == ("", "Oslo.")


@pytest.mark.parametrize("written", ["<think>", "<think></think>"])
def test_a_completion_with_no_answer_after_its_thought_has_null_content(client, written):
    message = ask(client, written).choices[0].message
    assert (message.reasoning, message.content) == (None, None)  # as vLLM's reasoning parsers give it


def test_a_prompt_that_closes_the_thought_empty_or_quotes_the_tag_is_read_as_the_template_meant(client):
    closed = ask(client, "Oslo. <think> is a tag.", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (closed.choices[0].message.reasoning, closed.choices[0].message.content) == (None, "Oslo. <think> is a tag.")
    quoted = client.chat.completions.create(  # only what the template adds for the answer says where it starts
        model=MODEL, messages=[{"role": "user", "content": "What does the <think> tag do?"}], max_tokens=8,
        temperature=0).choices[0].message  # the random model writes no tag
    assert quoted.reasoning is None and quoted.content


def test_a_grammar_under_a_prompt_that_opens_the_thought_writes_the_answer(client):
    opened = {"chat_template_kwargs": {"think_in_prompt": True}}  # DeepSeek-R1's and QwQ's templates
    call = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                          max_tokens=60, extra_body=opened).choices[0]
    assert call.message.reasoning is None and call.message.tool_calls[0].function.name == "get_weather"
    answer = ask(client, "Oslo.", extra_body=opened).choices[0].message
    assert (answer.reasoning, answer.content) == (None, "Oslo.")


def test_tool_calls_are_read_from_the_answer_after_the_thought(client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for stream in (False, True):
        out = ask(client, f"<think>I need the weather.</think>\n\n{call}", stream=stream, tools=[WEATHER])
        if stream:
            chunks = list(out)
            reasoning, content = streamed_fields(chunks)
            calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
            reason = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]
        else:
            message, reason = out.choices[0].message, out.choices[0].finish_reason
            reasoning, content, calls = message.reasoning, message.content, message.tool_calls
        assert (reasoning, content or None, reason) == ("I need the weather.", None, "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather",
                                                                                       {"city": "Oslo"})]


def test_continuing_an_assistant_message_without_content_reads_no_thought_from_it(client):
    called = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}
    out = client.chat.completions.create(model=MODEL, messages=[*MESSAGES, called], max_tokens=3, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})  # before: a 500 (None has no rfind)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_without_a_reasoning_parser_the_thought_stays_content():
    engine = tiny_engine(max_seq_len=512, max_input_len=384)
    with LLM.load(engine) as llm, ServerThread(create_app(llm, engine, ServerSettings(model_name=MODEL))) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        message = ask(client, "<think>x</think>Oslo.").choices[0].message
    assert (message.content, message.reasoning) == ("<think>x</think>Oslo.", None)
    with pytest.raises(ValueError, match="'granite' is not one of deepseek_r1, qwen3"):
        ServerSettings(model_name=MODEL, reasoning_parser="granite")


def test_a_responses_stream_sends_the_thought_as_a_reasoning_item_before_the_message():
    from types import SimpleNamespace

    from kiln.runtime.outputs import StreamDelta
    from kiln.runtime.server.responses import _StreamedResponse

    def build(status, output, usage=None):
        return SimpleNamespace(model_dump=lambda mode=None: {"status": status, "output": output})

    no_tools = SimpleNamespace(format=None)
    stream = _StreamedResponse(no_tools, ReasoningSplitter(thinking=False), build, "msg_1", None)
    pieces = ["<think>", "Norway", "'s capital.</th", "ink>\n\nOs", "lo."]
    events = [e for i, piece in enumerate(pieces)
              for e in stream.render(0, StreamDelta("r", piece, [], i == len(pieces) - 1, "stop" if i == 4 else None))]
    kinds = [(e["type"], e.get("output_index")) for e in events]
    assert kinds[:4] == [("response.output_item.added", 0), ("response.reasoning_text.delta", 0),
                         ("response.reasoning_text.delta", 0), ("response.reasoning_text.done", 0)]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Norway's capital."
    assert ("response.output_text.delta", 1) in kinds and kinds[-1] == ("response.output_item.done", 1)
    assert [item["type"] for item in stream.output] == ["reasoning", "message"]
    assert stream.output[0]["content"] == [{"type": "reasoning_text", "text": "Norway's capital."}]
    assert stream.output[1]["content"][0]["text"] == "Oslo."


def test_a_responses_answer_cut_off_while_thinking_is_an_incomplete_reasoning_item_whole_and_streamed(tmp_path):
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine(max_seq_len=512, max_input_len=384), engine)
    (engine / "chat_template.jinja").write_text(TEMPLATE.replace("{% elif think_in_prompt %}", "{% else %}"))
    settings = ServerSettings(model_name=MODEL, reasoning_parser="deepseek_r1")
    with LLM.load(engine) as llm, ServerThread(create_app(llm, engine, settings)) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        kwargs = dict(model=MODEL, input="Capital of Norway?", max_output_tokens=12, temperature=0)
        whole = client.responses.create(**kwargs)
        events = list(client.responses.create(stream=True, **kwargs))
    streamed = events[-1].response  # response.incomplete's
    assert "response.reasoning_text.delta" in {event.type for event in events}
    for response in (whole, streamed):
        assert response.status == "incomplete" and [item.type for item in response.output] == ["reasoning"]
        assert response.output[0].status == "incomplete" and response.output_text == ""
    assert streamed.output[0].content[0].text == whole.output[0].content[0].text != ""


def test_a_thought_that_ended_is_a_completed_reasoning_item_though_the_answer_was_cut_off(client):
    kwargs = dict(model=MODEL, input="Capital of Norway?", max_output_tokens=13,  # cut off after </think>
                  extra_body={"structured_outputs": {"regex": "<think>ab</think>\n\nhello world"}})
    whole = client.responses.create(**kwargs)
    streamed = list(client.responses.create(stream=True, **kwargs))[-1].response
    for response in (whole, streamed):
        assert response.status == "incomplete" and response.output[0].content[0].text == "ab"
        assert response.output[0].status == "completed" and response.output_text == ""
        assert response.usage.output_tokens_details.reasoning_tokens > 0  # the thought's "ab"


def test_a_responses_streams_text_logprobs_are_the_answers_tokens_not_the_thoughts(client):
    events = list(client.responses.create(
        model=MODEL, input="Capital of Norway?", max_output_tokens=40, stream=True,
        include=["message.output_text.logprobs"],
        extra_body={"structured_outputs": {"regex": "<think>ab</think>Oslo"}}))
    [done] = [event for event in events if event.type == "response.output_text.done"]
    assert done.text == "Oslo" and "".join(entry.token for entry in done.logprobs) == "Oslo"


@pytest.mark.parametrize("written", ["<scarf", "\n\nOslo"])
def test_a_streamed_answer_without_a_thought_keeps_the_logprobs_of_text_held_as_a_possible_tag(client, written):
    events = list(client.responses.create(
        model=MODEL, input="Capital of Norway?", max_output_tokens=40, stream=True,
        include=["message.output_text.logprobs"], extra_body={"structured_outputs": {"choice": [written]}}))
    [done] = [event for event in events if event.type == "response.output_text.done"]
    assert done.text == written and "".join(entry.token for entry in done.logprobs) == written


def test_a_reasoning_item_passed_back_is_the_next_assistant_messages_reasoning_content():
    from kiln.runtime.server.responses import chat_request
    from kiln.runtime.server.responses_protocol import ResponsesRequest

    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
               "content": [{"type": "reasoning_text", "text": "Weather first."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    request = ResponsesRequest.model_validate({"model": MODEL, "input": [
        {"role": "user", "content": "Oslo?"}, thought, call,
        {"type": "function_call_output", "call_id": "c1", "output": "rain"}]})
    [user, assistant, tool] = chat_request(request).messages
    assert (assistant.role, assistant.reasoning_content, assistant.tool_calls[0].id) == ("assistant",
                                                                                          "Weather first.", "c1")
    summarised = {**thought, "content": None, "summary": [{"type": "summary_text", "text": "Weather first."}]}
    request = ResponsesRequest.model_validate({"model": MODEL, "input": [summarised, call]})  # as OpenAI returns one
    assert chat_request(request).messages[0].reasoning_content == "Weather first."


def test_responses_take_chat_template_kwargs_and_reasoning_effort_none_turns_thinking_off(client):
    def input_tokens(**kwargs) -> int:
        return client.responses.create(model=MODEL, input="Capital of Norway?", max_output_tokens=1,
                                       **kwargs).usage.input_tokens

    thinking = input_tokens()
    closed = input_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # the empty thought
    assert closed > thinking and input_tokens(reasoning={"effort": "none"}) == closed
    assert input_tokens(reasoning={"effort": "none"}, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
                        ) == thinking  # what the request sets wins


def test_chat_reasoning_effort_none_turns_thinking_off_as_the_responses_api_does(client):
    def prompt_tokens(ignored: set[str] = frozenset(), **kwargs) -> int:
        response = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                                                     **kwargs)
        named = set(response.headers.get("Kiln-Ignored-Fields", "").split(", "))
        assert named & {"reasoning_effort", "chat_template_kwargs.enable_thinking"} == ignored
        return response.parse().usage.prompt_tokens

    closed = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # the empty thought
    # its template reads enable_thinking, which "none" sets, and no reasoning_effort: "high" changes nothing
    assert prompt_tokens(reasoning_effort="none") == closed > prompt_tokens({"reasoning_effort"},
                                                                            reasoning_effort="high")
    assert prompt_tokens(reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}}
                         ) < closed  # what the request's kwargs set wins


def test_an_earlier_thought_reaches_the_template_by_both_names_and_the_responses_effort_as_chats():
    from types import SimpleNamespace

    from kiln.runtime.chat_template import ChatTemplate
    from kiln.runtime.server.chat import render_chat
    from kiln.runtime.server.protocol import ChatMessage
    from kiln.runtime.server.responses import chat_request
    from kiln.runtime.server.responses_protocol import ResponsesRequest

    model = SimpleNamespace(chat_template=ChatTemplate(
        "{% for m in messages %}{{ m.reasoning }}|{{ m.reasoning_content }}{% endfor %}", {}))
    earlier = ChatMessage(role="assistant", content="Oslo.", reasoning_content="Norway's capital.")
    assert render_chat(model, [earlier], None) == "Norway's capital.|Norway's capital."
    request = ResponsesRequest.model_validate({"model": MODEL, "input": "Oslo?", "reasoning": {"effort": "low"}})
    assert chat_request(request).reasoning_effort == "low"
