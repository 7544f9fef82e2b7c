"""`LLM.chat`, vLLM's offline chat: conversations through the engine's chat template, with transformers'
``apply_chat_template`` as the oracle; and vLLM's ``sampling_params`` and ``use_tqdm`` arguments."""

from __future__ import annotations

import pytest

from kiln import ChatInputError
from kiln.runtime import SamplingParams
from kiln.runtime.conversations import load_template

GREEDY = SamplingParams(temperature=0, max_tokens=4)
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def hf_tokenizer(llm):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llm.engine_dir)


def oracle_ids(hf_tokenizer, messages: list[dict], **kwargs) -> list[int]:
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_conversation_is_rendered_as_transformers_renders_it_and_completed(llm, hf_tokenizer):
    [output] = llm.chat(CONVERSATION, GREEDY)
    assert output.prompt_token_ids == oracle_ids(hf_tokenizer, CONVERSATION, add_generation_prompt=True)
    assert output.prompt == hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert output.token_ids == llm.generate(output.prompt_token_ids, GREEDY)[0].token_ids


def test_several_conversations_get_one_output_each_in_order(llm, hf_tokenizer):
    other = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    outputs = llm.chat([CONVERSATION, other], sampling_params=GREEDY)  # vLLM's keyword
    assert [o.prompt_token_ids for o in outputs] == [
        oracle_ids(hf_tokenizer, CONVERSATION, add_generation_prompt=True),
        oracle_ids(hf_tokenizer, [{"role": "user", "content": "Hi\nthere"}], add_generation_prompt=True)]


@pytest.mark.parametrize("prefill", ["The colour is", "", "<", "s", " trailing "])  # "<", "s": of the </s> after it
def test_continue_final_message_continues_the_assistants_text(llm, hf_tokenizer, prefill):
    messages = [*CONVERSATION, {"role": "assistant", "content": prefill}]
    [output] = llm.chat(messages, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert output.prompt_token_ids == oracle_ids(hf_tokenizer, messages, continue_final_message=True)
    with pytest.raises(ChatInputError, match="continue_final_message needs add_generation_prompt=False"):
        llm.chat(messages, GREEDY, continue_final_message=True)


@pytest.mark.parametrize(("messages", "words"), [
    ("hello", "messages must be a non-empty list of message dicts"),
    ([{"role": "robot", "content": "x"}], "message 0: role must be one of"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text content"),
    ([CONVERSATION, []], r"messages\[1\]: each conversation is a non-empty list"),
    ([["hello"]], r"messages\[0\]: message 0 is a str, not a message dict"),
    ([{"role": "tool", "content": "42"}], "message 0: a 'tool' message names the tool_call_id"),
    ([CONVERSATION[0], "oops"], "message 1 is a str, not a message dict"),
    ([CONVERSATION[0], {"role": "assistant", "content": None, "tool_calls": [  # the bundled template renders none
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "does not render tool calls, so those of message 1 would be left out of the prompt"),
])
def test_messages_it_cannot_render_are_refused_naming_the_problem(llm, messages, words):
    with pytest.raises(ChatInputError, match=words):
        llm.chat(messages, GREEDY)


def test_messages_reach_the_template_as_the_server_passes_them(llm):
    from kiln.runtime.chat_template import template_message
    from kiln.runtime.server.protocol import ChatMessage

    for message in ({"role": "assistant", "content": "Paris", "reasoning_content": "think"},
                    {"role": "assistant", "content": None, "refusal": "I can't"},
                    {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}):
        served = template_message(ChatMessage.model_validate(message).model_dump(exclude_none=True))
        assert template_message(message) == served


def test_tools_the_template_cannot_render_are_refused_and_unread_variables_warned_of(llm, caplog):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(ChatInputError, match="does not render tools"):  # the bundled template renders none
        llm.chat(CONVERSATION, GREEDY, tools=[tool])
    with caplog.at_level("WARNING", logger="kiln.runtime"):
        llm.chat(CONVERSATION, GREEDY, chat_template_kwargs={"enable_thinking": False})
    assert "chat_template_kwargs 'enable_thinking': the chat template never reads them" in caplog.text


def test_params_are_given_once_and_a_chat_needs_a_template(llm):
    with pytest.raises(TypeError, match="not both"):
        llm.generate("hi", GREEDY, sampling_params=GREEDY)
    with pytest.raises(ChatInputError, match="pass chat_template="):  # an LLM made without an engine directory
        load_template(None, None)
    with pytest.raises(ChatInputError, match="chat_template is empty"):
        llm.chat(CONVERSATION, GREEDY, chat_template=" ")
    for source in ("defualt", "/srv/templates/chatml.jinja"):  # a misspelt name, a path: it would render as itself
        with pytest.raises(ChatInputError, match=f"chat_template '{source}' is no template .* and no template's name"):
            llm.chat(CONVERSATION, GREEDY, chat_template=source)
    with pytest.raises(ChatInputError, match="is no template"):
        load_template(None, "chatml")
    [output] = llm.chat(CONVERSATION, GREEDY, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    assert output.prompt_token_ids == llm.tokenizer.encode("Be brief.Name a colour.", add_special_tokens=False)


def test_use_tqdm_draws_progress_on_stderr_and_changes_no_output(llm, capsys):
    plain = llm.generate(["a", "b"], GREEDY)
    shown = llm.generate(["a", "b"], GREEDY, use_tqdm=True)
    assert [o.token_ids for o in shown] == [o.token_ids for o in plain]
    captured = capsys.readouterr()
    assert "Processed prompts" in captured.err and "2/2" in captured.err and captured.out == ""


def test_a_tqdm_like_class_draws_the_bar_as_in_vllm(llm):
    made = []

    class Bar:  # what vLLM asks of one: tqdm's arguments, update and close
        def __init__(self, **kwargs) -> None:
            self.done, self.total, self.closed = 0, kwargs["total"], False
            made.append(self)

        def update(self, n: int) -> None:
            self.done += n

        def close(self) -> None:
            self.closed = True

    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=Bar)
    assert [(bar.total, bar.done, bar.closed) for bar in made] == [(3, 3, True)]


def test_a_chat_needs_the_engine_directory_no_more_after_the_load(tmp_path, llm):
    import shutil

    from kiln import LLM, EngineClosedError

    shutil.copytree(llm.engine_dir, tmp_path / "engine")
    moved = LLM.load(tmp_path / "engine")
    try:
        shutil.rmtree(tmp_path / "engine")  # a service that unpacked the engine and cleaned up
        [output] = moved.chat(CONVERSATION, GREEDY)
        assert output.prompt_token_ids == llm.chat(CONVERSATION, GREEDY)[0].prompt_token_ids
    finally:
        moved.close()
    with pytest.raises(EngineClosedError):
        moved.chat(CONVERSATION, GREEDY)
