"""Tool calling through the official openai client: tools rendered by the chat template, calls forced by the
grammar (tool_choice "required" or a named function) in the template's own format (Hermes / Qwen and Llama 3.1
styles), parsed into message.tool_calls, streamed as tool-call deltas, and refused where the template has no tools."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shutil
from collections.abc import Iterator
from typing import Literal

import jsonschema_rs
import openai
import pydantic
import pytest

from kiln.runtime import LLM
from kiln.runtime.chat_template import ChatTemplate
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from kiln.runtime.server.tool_calls import HERMES, LLAMA3_JSON, MISTRAL, tool_call_format
from tests.test_server_support import tiny_engine

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {  # other keys: not said, not generated
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]

# trimmed versions of the Qwen2.5 and Llama 3.1 chat templates: the parts that render tools and tool turns
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA3_TEMPLATE = """{%- if tools %}<|start_header_id|>user<|end_header_id|>

Respond with a JSON for a function call: {"name": function name, "parameters": dictionary of argument name and its \
value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

<|python_tag|>{"name": "{{ message.tool_calls[0].function.name }}", "parameters": \
{{ message.tool_calls[0].function.arguments | tojson }}}<|eom_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
# a trimmed Mistral v0.3 template: the array of calls after [TOOL_CALLS], and its check of their ids
MISTRAL_TEMPLATE = """{%- if tools %}[AVAILABLE_TOOLS] [{% for tool in tools %}{{ tool | tojson }}\
{% if not loop.last %}, {% endif %}{% endfor %}][/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == "user" %}[INST] {{ message.content }}[/INST]
{%- elif message.tool_calls %}[TOOL_CALLS] [{% for call in message.tool_calls %}
{%- if call.id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\
{% endif %}{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": \
"{{ call.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]</s>
{%- elif message.role == "tool" %}[TOOL_RESULTS] {"content": {{ message.content | tojson }}, "call_id": \
"{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- else %}{{ message.content }}</s>
{%- endif %}
{%- endfor %}"""
TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3_json": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}


@pytest.fixture(scope="module")
def llm():
    with LLM.load(tiny_engine(max_seq_len=1024, max_input_len=896)) as llm:
        yield llm


def client_for(llm, tmp_path_factory, template: str | None):
    engine = tmp_path_factory.mktemp("engine") / "engine"
    shutil.copytree(tiny_engine(max_seq_len=1024, max_input_len=896), engine)
    if template is not None:
        (engine / "chat_template.jinja").write_text(template)
    return ServerThread(create_app(llm, engine, ServerSettings(model_name=MODEL)))


@contextlib.contextmanager
def hermes_openai_client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    """An openai client of a server of its own tiny engine whose template teaches Hermes tool calls."""
    with LLM.load(tiny_engine(max_seq_len=1024, max_input_len=896)) as llm, \
            client_for(llm, tmp_path_factory, HERMES_TEMPLATE) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module", params=list(TEMPLATES))
def client(request, llm, tmp_path_factory):
    with client_for(llm, tmp_path_factory, TEMPLATES[request.param]) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        yield client


def assert_valid_call(call, tool: dict) -> None:
    assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}|[0-9a-f]{9}", call.id)  # OpenAI's; Mistral's
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    assert jsonschema_rs.validator_for(tool["function"]["parameters"]).is_valid(arguments), arguments


def test_required_tool_choice_returns_calls_that_follow_their_schema(client, request):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                         tool_choice="required", max_tokens=120, seed=1)
    choice, calls = out.choices[0], out.choices[0].message.tool_calls
    # the random model goes on calling until the limit in Mistral's array (the other formats' runs end)
    assert choice.finish_reason == "tool_calls" or request.node.callspec.params["client"] == "mistral"
    whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # the last one cut off
    assert whole
    for call in whole:
        assert_valid_call(call, {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name])


def test_a_named_tool_choice_calls_that_function_once(client, llm):
    newline = llm.tokenizer.encode("\n", add_special_tokens=False)[-1]  # what would start a second call
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=120,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=2,
                                         logit_bias={str(newline): 30})
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and out.choices[0].finish_reason == "stop"  # as OpenAI and vLLM say for a named call
    assert_valid_call(calls[0], CLOCK)
    assert set(json.loads(calls[0].function.arguments)) == {"zone"}
    untyped = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=120,
                                             tool_choice={"function": {"name": "get_time"}}, seed=2,  # vLLM takes it
                                             logit_bias={str(newline): 30})
    assert [call.function.name for call in untyped.choices[0].message.tool_calls] == ["get_time"]


def test_a_forced_call_cut_off_by_max_tokens_comes_back_as_far_as_it_got(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], seed=2, parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(max_tokens=120, logprobs=True, **kwargs).choices[0]
    written = itertools.accumulate(token.token for token in whole.logprobs.content)
    cut_at = next(i for i, text in enumerate(written) if '"zone":"' in text) + 1  # inside the arguments
    cut = client.chat.completions.create(max_tokens=cut_at, **kwargs).choices[0]
    streamed = [c.choices[0] for c in client.chat.completions.create(max_tokens=cut_at, stream=True, **kwargs)
                if c.choices]
    arguments = cut.message.tool_calls[0].function.arguments
    assert cut.finish_reason == "length" and cut.message.content is None
    assert [c.function.name for c in cut.message.tool_calls] == ["get_time"]
    compact = json.dumps(json.loads(whole.message.tool_calls[0].function.arguments), separators=(",", ":"))
    assert arguments.startswith('{"zone":"') and compact.startswith(arguments) and arguments != compact
    assert [p.function.arguments for c in streamed for p in c.delta.tool_calls or []] == [arguments]
    assert not "".join(c.delta.content or "" for c in streamed)


def test_streamed_tool_calls_assemble_in_the_openai_client(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=120, seed=3,
                  parallel_tool_calls=False)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    parts = [call for delta in deltas for call in delta.tool_calls or []]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert len(parts) == 1
    assert_valid_call(parts[0], WEATHER)
    assert not "".join(delta.content or "" for delta in deltas)  # no call text as content
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    assert (whole.function.name, whole.function.arguments) == (parts[0].function.name, parts[0].function.arguments)
    assert chunks[-1].choices[0].delta.tool_calls is None  # the finish reason after the calls, in its own chunk
    with client.chat.completions.stream(**kwargs) as stream:  # the SDK's helper sees each call end
        assert "tool_calls.function.arguments.done" in [event.type for event in stream]


def test_auto_lets_the_model_answer_in_text_and_history_with_calls_renders(client):
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call00001", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call00001", "content": "4 degrees, rain"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=8, seed=4,
                                         extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"  # random weights write text
    assert choice.message.content


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
    (dict(tool_choice="required"), "needs tools"),
])
def test_tool_requests_that_cannot_be_served_are_a_400(client, kwargs, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kwargs)


def test_a_forced_call_of_a_tool_whose_schema_cannot_be_enforced_names_that_tool(client):
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"properties": {"a": {"type": "nonsense"}}}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=[WEATHER, odd],
                                       tool_choice="required")
    assert refused.value.param == "tools[1].function.parameters"  # before: null, and the calls' grammar quoted
    assert "'odd'" in refused.value.message and "nonsense" in refused.value.message
    assert "start:" not in refused.value.message


def test_a_template_without_tools_refuses_them_unless_tool_choice_is_none(llm, tmp_path_factory):
    with client_for(llm, tmp_path_factory, None) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="does not render tools"):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=4)
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="none",
                                             max_tokens=4)
        assert out.choices[0].message.tool_calls is None


def test_the_formats_are_read_from_templates_and_parse_what_they_teach():
    assert tool_call_format(HERMES_TEMPLATE) is HERMES and tool_call_format(LLAMA3_TEMPLATE) is LLAMA3_JSON
    assert tool_call_format(MISTRAL_TEMPLATE) is MISTRAL
    content, calls = HERMES.parse('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                                  '<tool_call>{"name": "b", "arguments": {}}</tool_call>', {"a", "b"})
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}),
                                                                                                  ("b", {})]
    assert LLAMA3_JSON.parse('<|python_tag|>{"name": "a", "parameters": {"x": 2}}', {"a"})[1][0].arguments == '{"x": 2}'
    assert HERMES.parse("no calls here <tool_call>{broken", {"a"}) == ("no calls here <tool_call>{broken", [])
    assert HERMES.content_before_calls("Sure <tool_") == len("Sure")  # nor the whitespace parse strips before it
    assert LLAMA3_JSON.content_before_calls(' {"na') == 0 and LLAMA3_JSON.content_before_calls("Hi") == 2
    rendered = ChatTemplate(HERMES_TEMPLATE, {}).render(
        [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                               "function": {"name": "a", "arguments": {"x": 1}}}]}],
        tools=[WEATHER])
    assert '"arguments": {"x": 1}' in rendered and '"name": "get_weather"' in rendered


def test_a_cut_off_call_is_read_as_far_as_it_got_once_its_name_is_whole():
    call = HERMES.cut_off_call('<tool_call>\n{"name":"a","arguments":{"x":', {"a"})
    assert (call.name, call.arguments) == ("a", '{"x":')
    assert HERMES.cut_off_call('<tool_call>\n{"name":"a","arguments":{}}\n</tool', {"a"}) is None  # parse reads it
    assert HERMES.cut_off_call('<tool_call>\n{"name":"a","arguments":{}}\n</tool_call>', {"a"}) is None
    assert HERMES.cut_off_call('<tool_call>\n{"name":"ab', {"ab"}) is None  # the name may go on
    assert LLAMA3_JSON.cut_off_call('{"name": "a", "parameters": {"x": [1', {"a"}).arguments == '{"x": [1'
    assert LLAMA3_JSON.cut_off_call('{"name": "b", "parameters": {', {"a"}) is None


def test_llama3_json_calls_are_read_whole_even_with_a_semicolon_in_an_argument():
    content, calls = LLAMA3_JSON.parse('{"name": "sql", "parameters": {"q": "SELECT 1; SELECT 2"}} ; '
                                       '{"name": "sql", "arguments": {"q": "b"}}', {"sql"})
    assert content == "" and [json.loads(c.arguments)["q"] for c in calls] == ["SELECT 1; SELECT 2", "b"]


@pytest.mark.parametrize(("format_", "text"), [
    (LLAMA3_JSON, '{"name": "Alice", "age": 30}'),  # a JSON answer, not a call
    (LLAMA3_JSON, '{"name": "sql"}'),  # no parameters
    (LLAMA3_JSON, '{"name": "drop_tables", "parameters": {}}'),  # not among the tools
    (LLAMA3_JSON, '{"name": "sql", "parameters": {}} and more'),
    (HERMES, '<tool_call>\n{"name": "drop_tables", "arguments": {}}\n</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "sql"}\n</tool_call>'),
])
def test_text_that_is_no_call_of_the_requests_tools_stays_content(format_, text):
    assert format_.parse(text, {"sql"}) == (text, [])


def whitespace_bias(llm) -> dict[str, int]:
    """A logit bias that makes every whitespace token the model's first choice."""
    tokenizer = llm.tokenizer
    return {str(i): 100 for i in range(tokenizer.vocab_size) if (text := tokenizer.token_bytes(i)) and not text.strip()}


def test_a_forced_call_comes_back_as_a_call_even_from_a_model_that_prefers_whitespace(client, llm):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[CLOCK], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=60, seed=5,
                                         logit_bias=whitespace_bias(llm))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1  # no JSON whitespace to pad
    assert_valid_call(choice.message.tool_calls[0], CLOCK)


def test_without_parallel_tool_calls_auto_keeps_the_first_call_and_a_stream_says_what_the_response_does(
        llm, tmp_path_factory):
    calls = "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>\n'
                    for n, a in (("get_time", '{"zone": "utc"}'), ("get_weather", '{"city": "Oslo", "unit": "c"}')))
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], parallel_tool_calls=False, max_tokens=120,
                  extra_body={"structured_outputs": {"choice": [f"Let me check.\n{calls}"]}})
    with client_for(llm, tmp_path_factory, HERMES_TEMPLATE) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        message = client.chat.completions.create(**kwargs).choices[0].message
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert message.content == "Let me check." and [c.function.name for c in message.tool_calls] == ["get_time"]
    assert "".join(c.delta.content or "" for c in chunks) == message.content
    assert [c.function.name for chunk in chunks for c in chunk.delta.tool_calls or []] == ["get_time"]


def test_calls_cut_off_by_max_tokens_finish_with_length_and_a_parsed_answer_passed_back_is_taken(llm, tmp_path_factory):
    calls = "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>\n'
                    for n, a in (("get_time", '{"zone": "utc"}'), ("get_weather", '{"city": "Oslo", "unit": "c"}')))
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK],
                  extra_body={"structured_outputs": {"choice": [calls]}})
    with client_for(llm, tmp_path_factory, HERMES_TEMPLATE) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        whole = client.chat.completions.create(max_tokens=200, logprobs=True, **kwargs)
        written = list(itertools.accumulate(token.token for token in whole.choices[0].logprobs.content))
        inside = next(i for i, text in enumerate(written) if '"city": "Os' in text) + 1  # the second call's JSON
        cut = client.chat.completions.create(max_tokens=inside, **kwargs).choices[0]
        unclosed = client.chat.completions.create(max_tokens=len(written) - 2, **kwargs).choices[0]  # JSON whole
        message = whole.choices[0].message.model_dump()  # as the SDK's parse helpers return it
        message["parsed"] = None
        message["tool_calls"][0]["function"]["parsed_arguments"] = {"zone": "utc"}
        again = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            *MESSAGES, message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "noon"}])
    assert whole.choices[0].finish_reason == "tool_calls" and len(whole.choices[0].message.tool_calls) == 2
    assert cut.finish_reason == "length" and [c.function.name for c in cut.message.tool_calls] == ["get_time"]
    assert [c.function.name for c in unclosed.message.tool_calls] == ["get_time", "get_weather"]  # as vLLM reads it
    assert again.choices[0].finish_reason == "length"


def test_a_streamed_turn_of_two_calls_sends_one_a_chunk_and_the_helpers_final_message_is_taken_back(
        llm, tmp_path_factory):
    calls = "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>\n'
                    for n, a in (("get_time", '{"zone": "utc"}'), ("get_weather", '{"city": "Zürich", "unit": "c"}')))
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=200,
                  extra_body={"structured_outputs": {"choice": [calls]}})
    with client_for(llm, tmp_path_factory, HERMES_TEMPLATE) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        with client.chat.completions.stream(**kwargs) as stream:
            for _ in stream:
                pass
        message = stream.get_final_completion().choices[0].message  # its tool calls keep the stream's "index"
        again = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            *MESSAGES, message.model_dump(), {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                                              "content": "noon"}])
    per_chunk = [len(delta.tool_calls) for delta in deltas if delta.tool_calls]
    assert per_chunk == [1, 1]  # as OpenAI and vLLM send them: accumulators that read a delta's first call see both
    assert json.loads(message.tool_calls[1].function.arguments)["city"] == "Zürich"
    assert '"Zürich"' in message.tool_calls[1].function.arguments  # not escaped, as OpenAI writes arguments
    assert again.choices[0].finish_reason == "length"


def test_a_forced_call_sets_the_output_format_aside_for_its_turn_and_says_so(client):
    """An agent sends its final answer's schema on every turn: the forced call's grammar wins, as in vLLM."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, tools=[CLOCK], tool_choice="required", max_tokens=60, seed=5,
        parallel_tool_calls=False, response_format={"type": "json_object"})
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_time"
    assert raw.headers["kiln-ignored-fields"] == "response_format"


def test_forced_calls_of_tools_with_nested_models_or_no_parameters_follow_their_schemas(client):
    nested = openai.pydantic_function_tool(Lookup)
    assert "$defs" in nested["function"]["parameters"]  # pydantic's nested model: a $ref into them
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[nested], tool_choice="required",
                                         max_tokens=120, seed=1, parallel_tool_calls=False)
    assert_valid_call(out.choices[0].message.tool_calls[0], nested)
    for parameters in ({"type": "object", "properties": {}}, None):  # LangChain's tool of no arguments; none at all
        bare = {"type": "function", "function": {"name": "get_time", **({"parameters": parameters} if parameters
                                                                          else {})}}
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[bare], tool_choice="required",
                                             max_tokens=60, seed=1, parallel_tool_calls=False)
        assert out.choices[0].finish_reason == "tool_calls", out.choices[0].message
        assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {}


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)


class Lookup(pydantic.BaseModel):
    address: Address
    unit: Literal["c", "f"]


def test_a_hermes_call_whose_closing_tag_never_came_is_still_a_call_as_vllm_reads_it():
    call = '<tool_call>\n{"name": "a", "arguments": {"x": 1}}'
    assert [c.arguments for c in HERMES.parse(call, {"a"})[1]] == ['{"x": 1}']  # a stop string at </tool_call>
    two = HERMES.parse(f"{call}\n</tool_call>\n{call.replace('1', '2')}", {"a"})[1]
    assert [c.arguments for c in two] == ['{"x": 1}', '{"x": 2}']
    cut = HERMES.parse(f'{call}\n</tool_call>\n<tool_call>\n{{"name": "a", "argu', {"a"})[1]  # cut: left out
    assert [c.arguments for c in cut] == ['{"x": 1}']


def test_mistral_calls_are_a_json_array_with_ids_its_templates_take_back():
    content, calls = MISTRAL.parse(' [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
                                   {"a", "b"})
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert all(re.fullmatch(r"[0-9a-zA-Z]{9}", c.id) for c in calls)
    assert MISTRAL.parse('[TOOL_CALLS][{"name": "a", "arguments": {}}]', {"a"})[1][0].name == "a"  # marker as text
    assert MISTRAL.parse('[{"name": "a", "arguments": {}}', {"a"})[1][0].name == "a"  # stopped before "]"
    for text in ('[{"name": "a", "arguments": {}}] and more', '[1, 2]', "[see the docs](x)", '[{"name": "z"}]'):
        assert MISTRAL.parse(text, {"a"}) == (text, [])
    cut = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"q": "ab'
    assert [c.name for c in MISTRAL.parse(cut, {"a", "b"})[1]] == ["a"]
    assert MISTRAL.cut_off_call(cut, {"a", "b"}).arguments == '{"q": "ab'
    assert MISTRAL.cut_off_call('[{"name": "a", "arguments": {}}]', {"a"}) is None
    assert MISTRAL.content_before_calls(" [{") == 0 and MISTRAL.content_before_calls("Hi [") == 2  # calls may follow
    assert MISTRAL.content_before_calls("[1] says") == 8 and MISTRAL.content_before_calls("[TOOL_C") == 0
    pretty = '[\n  {"name": "a", "arguments": {"x": 1}}\n]'
    assert [c.arguments for c in MISTRAL.parse(pretty, {"a"})[1]] == ['{"x": 1}']
    history = [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "a", "arguments": calls[0].arguments}}]}]
    assert calls[0].id in ChatTemplate(MISTRAL_TEMPLATE, {}).render(history)


@pytest.mark.parametrize("name", ["weather.get-current:v2", "srv/tool#1"])
def test_tools_named_as_mcp_servers_name_them_are_called(client, name):
    mcp = {"type": "function", "function": {"name": name, "parameters": {  # a $ref: the name is in no JSON pointer
        "type": "object", "$defs": {"c": {"type": "string", "maxLength": 4}}, "properties": {"city": {
            "$ref": "#/$defs/c"}}, "required": ["city"]}}}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[mcp], max_tokens=60,
                                         tool_choice={"type": "function", "function": {"name": name}})
    assert [call.function.name for call in out.choices[0].message.tool_calls or []] == [name]
    for bad in ("two words", 'we"ird', "<tool_call>"):  # a call's JSON would escape them, or a template's tags hold
        with pytest.raises(openai.BadRequestError) as refused:  # them; before: dots refused, as OpenAI refuses them
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=[
                {"type": "function", "function": {"name": bad}}])
        assert refused.value.param == "tools[0].function.name"


def test_forced_calls_whose_grammar_would_be_too_large_or_deep_are_a_400_naming_the_tools(client):
    from tests.test_structured_output import chained

    deep = {"type": "function", "function": {"name": "deep", "parameters": chained(1000)}}
    with pytest.raises(openai.BadRequestError) as refused:  # before: the server process crashed
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=[WEATHER, deep],
                                       tool_choice="required")
    assert refused.value.param == "tools[1].function.parameters" and "$refs one inside another" in refused.value.message
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3000)]
    with pytest.raises(openai.BadRequestError) as refused:  # before: a 500
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=many,
                                       tool_choice="required")
    assert refused.value.param == "tools" and "characters; at most" in refused.value.message


@pytest.mark.parametrize("format_", [HERMES, LLAMA3_JSON, tool_call_format(MISTRAL_TEMPLATE)])
def test_a_call_nested_deeper_or_with_longer_numbers_than_python_reads_stays_text_in_every_format(format_):
    for unreadable in ("[" * 100_000 + "]" * 100_000, "1" * 5000):
        text = f'{format_.prefix or ""}{{"name": "sql", "{format_.arguments_key}": {unreadable}'
        assert format_.parse(text, {"sql"})[1] == []  # before: RecursionError / ValueError, a 500
        format_.cut_off_call(text, {"sql"})  # reads as far as it can, raising nothing


def test_text_after_a_mistral_array_of_calls_is_dropped_as_after_hermes_calls():
    mistral = 'Sure.[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "utc"}}]\nDone.'
    hermes = 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\nDone.'
    for fmt, text in ((MISTRAL, mistral), (HERMES, hermes)):
        content, calls = fmt.parse(text, {"get_time"})
        assert (content, [(c.name, c.arguments) for c in calls]) == ("Sure.", [("get_time", '{"zone": "utc"}')])
    bare = '[{"name": "get_time", "arguments": {}}] says'  # no marker: an array of calls must end the text
    assert MISTRAL.parse(bare, {"get_time"}) == (bare, [])
