"""OpenAI features through the official openai client: log probabilities (chat and legacy completions, echo,
streamed), penalties and logit bias, and the fields a server may accept and ignore."""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pydantic
import pytest

from kiln.runtime import SamplingParams
from kiln.runtime.chat_template import ChatTemplate
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from tests.test_server_support import tiny_engine

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me about kilns."}]


@pytest.fixture(scope="module")
def client(llm):
    app = create_app(llm, tiny_engine(), ServerSettings(model_name=MODEL))
    with ServerThread(app) as server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
        yield c


def test_chat_logprobs_are_the_runtimes_with_token_bytes_that_spell_the_text(client, llm):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the most likely token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


def test_streamed_chat_logprobs_equal_the_unstreamed_ones(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **kwargs)
                for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
    # the second request prefills only what the prefix cache lacks: other shapes, so the last bits may differ
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-5)


def test_completion_echo_with_logprobs_scores_the_prompt_too(client, llm):
    prompt = "Once upon a time"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                                                   prompt_logprobs=2))[0]
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in expected.prompt_logprobs[1:] + expected.logprobs])


def test_echo_with_max_tokens_0_scores_the_prompt_alone_as_openai_legacy_completions_do(client, llm):
    kwargs = dict(model=MODEL, prompt="Monday, Tuesday,", max_tokens=0, logprobs=1, echo=True)
    out = client.completions.create(**kwargs)
    choice = out.choices[0]
    prompt = llm.generate("Monday, Tuesday,", SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert choice.text == "Monday, Tuesday," and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt.prompt_token_ids), 0)
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(prompt.prompt_token_ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in prompt.prompt_logprobs[1:]])
    chunks = [c for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == \
        choice.logprobs.tokens
    assert chunks[-1].usage.completion_tokens == 0


def test_sampled_tokens_are_among_their_top_logprobs(client):
    lp = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=20, logprobs=1, temperature=2,
                                   seed=3, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert all(top[token] == logprob for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                                                    strict=True))
    assert any(len(top) == 2 for top in lp.top_logprobs)  # at temperature 2 some sampled token is not the likeliest


def test_streamed_completion_echo_and_logprobs_equal_the_unstreamed_ones(client):
    kwargs = dict(model=MODEL, prompt="The cat", max_tokens=5, temperature=0, logprobs=1, echo=True,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    offsets = [t for c in chunks if c.logprobs for t in c.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset


def test_text_offsets_index_the_text_through_multi_byte_characters(client):
    out = client.completions.create(model=MODEL, prompt="café 😀", max_tokens=12, logprobs=0, echo=True,
                                    extra_body={"structured_outputs": {"regex": "é 😀 ok"}})
    text, lp = out.choices[0].text, out.choices[0].logprobs
    assert text == "café 😀é 😀 ok" and len(lp.tokens) > len(text)  # characters of several byte-level tokens
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):  # a piece of a character starts at it
        assert text.startswith(token.rstrip("\ufffd"), offset) and (token.isascii() or not text[offset].isascii())


def test_an_echoed_prompt_that_ends_inside_a_character_leaves_it_to_the_completion(client, llm):
    ids = llm.tokenizer.encode("café €", add_special_tokens=False)  # byte-level: € is three tokens, a byte each
    prompt, last = ids[:-1], ids[-1]
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logit_bias={str(last): 100})
    assert llm.tokenizer.decode(prompt + [last]) == "café €"
    assert client.completions.create(**kwargs).choices[0].text == "café €"  # before: "café \ufffd€"
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices) == \
        "café €"


def test_echoed_text_offsets_count_the_special_tokens_written_in_the_prompt(client):
    out = client.completions.create(model=MODEL, prompt="Question</s>Answer:", max_tokens=0, logprobs=0, echo=True)
    text, lp = out.choices[0].text, out.choices[0].logprobs
    assert text == "Question</s>Answer:" and "</s>" in lp.tokens
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert text.startswith(token, offset)


def test_an_echoed_token_id_prompt_keeps_its_special_tokens_as_vllm_decodes_it(client):
    text_prompt = client.completions.create(model=MODEL, prompt="Question</s>Answer:", max_tokens=0, logprobs=0,
                                            echo=True).choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in client.completions.create(
        model=MODEL, prompt="Question</s>Answer:", max_tokens=0, logprobs=0, echo=True,
        extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.tokens]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, logprobs=0, echo=True).choices[0]
    assert "</s>" in out.text and out.text.endswith("Question</s>Answer:")
    assert out.logprobs.tokens == text_prompt.logprobs.tokens
    for token, offset in zip(out.logprobs.tokens, out.logprobs.text_offset, strict=True):
        assert out.text.startswith(token, offset)


@pytest.mark.parametrize(("logprobs", "prompt_logprobs"), [(1, 5), (5, 0)])
def test_echo_and_prompt_logprobs_each_get_the_alternatives_they_asked_for(client, logprobs, prompt_logprobs):
    choice = client.completions.create(model=MODEL, prompt="Monday, Tuesday,", max_tokens=2, temperature=0, echo=True,
                                       logprobs=logprobs, extra_body={"prompt_logprobs": prompt_logprobs}).choices[0]
    lp = choice.logprobs  # each position's alternatives hold its own token too, as OpenAI documents
    assert max(len(top) for top in lp.top_logprobs[1:]) in (logprobs, logprobs + 1)  # fewer: tokens of one text
    assert all(lp.top_logprobs[i][token] == lp.token_logprobs[i] for i, token in enumerate(lp.tokens) if i)
    assert {len(entry) for entry in choice.prompt_logprobs[1:]} <= {prompt_logprobs, prompt_logprobs + 1}  # + own
    for entry in choice.prompt_logprobs[1:]:  # vLLM's ranks: the alternatives 1.., the prompt's own token its own
        ranks = [alternative["rank"] for alternative in entry.values()]
        assert ranks[1:] == [r for r in range(1, prompt_logprobs + 1) if r != ranks[0]][:len(ranks) - 1]


def test_penalties_and_logit_bias_match_the_runtime(client, llm):
    controls = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={"57": 3.0})
    out = client.completions.create(model=MODEL, prompt="The cat", max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.3}, **controls)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=1.2,
                            frequency_penalty=0.6, logit_bias={57: 3.0}, repetition_penalty=1.3)
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert llm.generate("The cat", params)[0].text != llm.generate("The cat", plain)[0].text
    assert out.choices[0].text == llm.generate("The cat", params)[0].text


def test_skip_special_tokens_false_keeps_generated_special_tokens_in_the_text(client, llm):
    kwargs = dict(model=MODEL, max_tokens=3, temperature=0, logit_bias={"0": 100})  # <s> every step
    for skip, text in ((True, ""), (False, "<s><s><s>")):
        extra = {"skip_special_tokens": skip}
        assert client.completions.create(prompt="Hi", extra_body=extra, **kwargs).choices[0].text == text
        chunks = client.chat.completions.create(messages=MESSAGES, stream=True, extra_body=extra, **kwargs)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    kept = client.completions.create(prompt="Hi", logprobs=0, extra_body={"skip_special_tokens": False}, **kwargs)
    assert kept.choices[0].logprobs.text_offset == [0, 3, 6]  # before: [0, 0, 0], the offsets of skipped tokens
    eos = dict(model=MODEL, max_tokens=3, temperature=0, logit_bias={"2": 100})  # </s> at once
    ended = [client.completions.create(prompt="Hi", extra_body={"include_stop_str_in_output": True,
                                                                "skip_special_tokens": skip}, **eos).choices[0]
             for skip in (True, False)]
    eos_text = llm.tokenizer.decode([2], skip_special_tokens=False)
    assert [(c.finish_reason, c.text) for c in ended] == [("stop", ""), ("stop", eos_text)]  # as vLLM keeps EOS


def test_allowed_token_ids_match_the_runtime(client, llm):
    allowed = [llm.tokenizer.encode(word)[0] for word in (" clay", " fire")]
    out = client.completions.create(model=MODEL, prompt="The cat", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    expected = llm.generate("The cat", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      allowed_token_ids=allowed))[0]
    assert set(expected.token_ids) <= set(allowed) and out.choices[0].text == expected.text


def test_fields_a_server_may_ignore_are_accepted_and_unknown_ones_still_refused(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, store=True, user="u-1",
                                         metadata={"team": "kiln"}, service_tier="auto", parallel_tool_calls=False,
                                         reasoning_effort="low", modalities=["text"], stream_options=None)
    assert out.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="not_a_field"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"not_a_field": 1})


def test_responses_api_text_parts_in_chat_content_are_read_as_text(client):
    def prompt_tokens(content) -> int:
        return client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": content}]).usage.prompt_tokens

    parts = [{"type": "input_text", "text": "Tell me"}, {"type": "output_text", "text": "about kilns."}]
    assert prompt_tokens(parts) == prompt_tokens("Tell me\nabout kilns.")


def test_response_format_json_schema_parses_into_the_clients_pydantic_model(client):
    class Kiln(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        temperature_c: int = pydantic.Field(ge=0, le=1400)
        electric: bool

    out = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0.8, seed=3,
                                        response_format=Kiln)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(out.choices[0].message.parsed, Kiln)


def test_json_object_and_vllm_structured_outputs_streamed(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, stream=True, seed=1,
                                            extra_body={"structured_outputs": {"choice": ["kiln", "oven", "forge"]}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("kiln", "oven", "forge")
    options = {"disable_any_whitespace": True, "disable_additional_properties": True}  # what this server does
    out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, seed=2,
                                    extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}", **options}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", out.choices[0].text)
    kept = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, seed=2, extra_body={
        "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}, "include_stop_str_in_output": True})
    assert kept.choices[0].text == out.choices[0].text  # a complete format stops on no stop string or token: no
    # text added (before: the last token's text again)
    with pytest.raises(openai.BadRequestError, match="disable_any_whitespace"):  # what it never does
        client.completions.create(model=MODEL, prompt="Code:", max_tokens=2, extra_body={
            "structured_outputs": {"regex": "[A-Z]", "disable_any_whitespace": False}})


def test_vllm_guided_fields_of_before_0_11_hold_the_output_as_structured_outputs_does(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, seed=1, extra_body={
        "guided_choice": ["kiln", "oven", "forge"], "guided_decoding_backend": "xgrammar"})
    assert out.choices[0].message.content in ("kiln", "oven", "forge")
    text = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, seed=2,
                                     extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"}).choices[0].text
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", text)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    answer = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=20, seed=3,
                                       extra_body={"guided_json": schema}).choices[0].text
    assert isinstance(json.loads(answer)["n"], int)
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={
            "guided_regex": "a", "structured_outputs": {"regex": "b"}})


@pytest.mark.parametrize(("extra", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "frob"),
    ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(["}}, "unclosed"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
])
def test_a_format_that_cannot_be_served_is_a_400(client, extra, words):
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)


@pytest.mark.parametrize(("route", "field"), [("chat", "response_format"), ("completions", "structured_outputs")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_format_that_cannot_go_on_mid_generation_is_a_400_naming_its_field(client, route, field, stream):
    endless = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}
    # streamed: an error event with the same body, which the client raises on (before: param null)
    with pytest.raises(openai.APIError if stream else openai.BadRequestError, match="cannot go on") as refused:
        if route == "chat":
            list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=stream,
                                                response_format=endless))
        else:
            list(client.completions.create(model=MODEL, prompt="a", max_tokens=4, stream=stream,
                                           extra_body={"structured_outputs": {"json": {"$ref": "#"}}}))
    assert refused.value.param == field


def test_openais_deprecated_and_web_search_fields_sent_as_null_are_not_given(client):  # a full model_dump()
    nulls = {"functions": None, "function_call": None, "web_search_options": None}
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=nulls).choices
    with pytest.raises(openai.BadRequestError, match="not supported by this server") as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, web_search_options={})
    assert refused.value.param == "web_search_options"


def test_vllm_extensions_at_their_defaults_are_accepted(client):
    defaults = {"skip_special_tokens": True, "include_stop_str_in_output": False, "spaces_between_special_tokens": True,
                "priority": 0, "add_generation_prompt": True, "continue_final_message": False, "echo": False,
                "add_special_tokens": False}
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": False},
                                            extra_body={**defaults, "ignore_eos": True})
    assert list(chunks)[-1].usage.completion_tokens == 2
    shared = {"use_beam_search": False, "length_penalty": 1.0, "return_token_ids": None, "allowed_token_ids": None,
              "bad_words": [], "ignore_eos": True}  # sampled: EOS could end one early
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body=shared)
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                           extra_body={**shared, "add_special_tokens": True})
    assert chat.usage.completion_tokens == completion.usage.completion_tokens == 2


def test_a_prompt_that_writes_its_own_bos_is_sent_with_add_special_tokens_false(client, llm, monkeypatch):
    encode, asked = llm.tokenizer.encode, []

    def recorded(text: str, add_special_tokens: bool = True) -> list[int]:
        asked.append(add_special_tokens)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(llm.tokenizer, "encode", recorded)  # the tiny tokenizer adds no BOS: whether it was asked to
    prompt = "<s>Once upon a time"  # the tokenizer's BOS, written in the text (a rendered template's)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=0)
    client.completions.create(**kwargs)
    once = client.completions.create(**kwargs, extra_body={"add_special_tokens": False})  # before: a 400
    assert asked == [True, False]
    assert once.usage.prompt_tokens == len(encode(prompt, add_special_tokens=False))
    assert once.choices[0].text.startswith(prompt) and once.choices[0].logprobs.text_offset[:2] == [0, 3]


def test_truncate_prompt_tokens_serves_a_too_long_prompt_from_its_last_tokens(client, llm):
    ids = [(7 * i) % 500 + 10 for i in range(100)]  # more than the tiny engine's 64 prompt tokens
    kwargs = dict(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    expected = llm.generate(ids[-20:], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    out = client.completions.create(**kwargs, extra_body={"truncate_prompt_tokens": 20, "ignore_eos": True})
    assert (out.choices[0].text, out.usage.prompt_tokens) == (expected.text, 20)
    assert client.completions.create(**kwargs, extra_body={"truncate_prompt_tokens": -1}).usage.prompt_tokens == 64
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "kiln " * 200}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 30})
    assert chat.usage.prompt_tokens == 30


def test_return_tokens_as_token_ids_names_every_logprobs_token_by_its_id(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    entries = [e for entry in chat.choices[0].logprobs.content for e in (entry, *entry.top_logprobs)]
    assert all(re.fullmatch(r"token_id:\d+", e.token) and bytes(e.bytes) == e.token.encode() for e in entries)
    legacy = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, temperature=0, logprobs=2,
                                       echo=True, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    names = [*legacy.tokens, *(key for top in legacy.top_logprobs if top for key in top)]
    assert all(re.fullmatch(r"token_id:\d+", name) for name in names)


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    stop, extra = full[3:6], {"ignore_eos": True, "include_stop_str_in_output": True}
    expected = full[:full.index(stop) + len(stop)]
    assert client.completions.create(**kwargs, stop=stop, extra_body=extra).choices[0].text == expected
    streamed = client.completions.create(**kwargs, stop=stop, stream=True, extra_body=extra)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected
    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    said = client.chat.completions.create(**chat, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = said[4:7]
    answer = client.chat.completions.create(**chat, stop=stop, extra_body=extra).choices[0].message.content
    chunks = client.chat.completions.create(**chat, stop=stop, stream=True, extra_body=extra)
    assert answer == "".join(c.choices[0].delta.content or "" for c in chunks) == said[:said.index(stop) + len(stop)]


def test_include_stop_str_in_output_keeps_the_text_of_a_stop_token_id_too(client, llm):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    out = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    ids = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # the first time this token comes
    stop_id, kept = ids[at], llm.tokenizer.decode(ids[:at + 1])
    assert out.choices[0].text.startswith(kept)
    cut = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id],
                                                          "include_stop_str_in_output": True})
    assert cut.choices[0].stop_reason == stop_id and cut.choices[0].text == kept  # before: without the token's text


def test_a_scored_prompts_streamed_usage_counts_no_completion_token_and_a_no_op_truncation_echoes_as_sent(client):
    chunks = list(client.completions.create(model=MODEL, prompt=["Monday,", "a b"], max_tokens=0, echo=True,
                                            logprobs=0, stream=True, stream_options={
                                                "include_usage": True, "continuous_usage_stats": True}))
    assert {chunk.usage.completion_tokens for chunk in chunks} == {0}  # before: 1 on each choice's chunk
    prompt = "Hello  world</s> é"
    echoed = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, temperature=0,
                                        extra_body={"truncate_prompt_tokens": keep}).choices[0].text
              for keep in (None, 100)]
    assert echoed[0].startswith(prompt) and echoed[1] == echoed[0]  # before: the </s> written in it was dropped


def test_a_continued_assistant_message_is_the_prompts_end_as_transformers_renders_it(client, llm):
    history = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
    template = ChatTemplate.from_dir(tiny_engine())
    kwargs = dict(model=MODEL, messages=history, max_tokens=4, temperature=0)
    whole = template.render(history, add_generation_prompt=False)
    prefill = whole[:whole.rindex("Once upon a") + len("Once upon a")]  # the assistant's text, not its end of turn
    expected = llm.generate(prefill, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    out = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True, "add_generation_prompt": False,
                                                               "continue_final_message": True, "prompt_logprobs": 0})
    prompt_ids = [int(next(iter(entry))) for entry in out.prompt_logprobs[1:]]  # the first token has no entry
    assert prompt_ids == llm.tokenizer.encode(prefill, add_special_tokens=False)[1:]
    assert llm.tokenizer.decode(prompt_ids).endswith("Assistant: Once upon a")
    assert out.choices[0].message.content == expected.text
    without = client.chat.completions.create(**kwargs, extra_body={"add_generation_prompt": False})
    with_prompt = client.chat.completions.create(**kwargs)
    assert without.usage.prompt_tokens == len(llm.tokenizer.encode(whole, add_special_tokens=False))
    assert with_prompt.usage.prompt_tokens == len(llm.tokenizer.encode(
        template.render(history), add_special_tokens=False)) > without.usage.prompt_tokens


def test_a_whole_response_is_built_off_the_event_loop(client, monkeypatch):
    from kiln.runtime.server import responding

    built_on_loop, build = [], responding.Utf8JSONResponse

    def recording(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            built_on_loop.append(True)
        except RuntimeError:
            built_on_loop.append(False)
        return build(*args, **kwargs)

    monkeypatch.setattr(responding, "Utf8JSONResponse", recording)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=2, logprobs=True,
                                         top_logprobs=2)
    assert len(out.choices) == 2 and built_on_loop == [False]
