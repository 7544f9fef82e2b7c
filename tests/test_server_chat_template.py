"""Chat templates render as Hugging Face renders them, and refuse what the template refuses."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.chat_template import ChatTemplate, ChatTemplateError, template_message

ALTERNATING = ("{{ bos_token }}{% for m in messages %}"
               "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
               "{% endif %}[{{ m['role'] }}] {{ m['content'] | trim }}\n"
               "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def write_config(directory, **config) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, **config}))


def test_template_renders_messages_with_special_tokens_and_generation_prompt(tmp_path):
    write_config(tmp_path, chat_template=ALTERNATING)
    template = ChatTemplate.from_dir(tmp_path)
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"}]
    assert template.render(messages) == "<s>[user] hi\n[assistant] hello\n[user] bye\n[assistant]"
    assert template.special_tokens["bos_token"] == "<s>"


def test_chat_template_kwargs_reach_the_template_and_may_not_replace_what_the_server_sets(tmp_path):
    thinking = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    write_config(tmp_path, chat_template=thinking)
    template = ChatTemplate.from_dir(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages) == "hi"
    assert template.render(messages, variables={"enable_thinking": False}) == "hi<think></think>"
    with pytest.raises(ChatTemplateError, match="may not set bos_token, messages"):
        template.render(messages, variables={"messages": [], "bos_token": "x"})


def test_template_refusal_becomes_a_chat_template_error(tmp_path):
    write_config(tmp_path, chat_template=ALTERNATING)
    with pytest.raises(ChatTemplateError, match="must alternate"):
        ChatTemplate.from_dir(tmp_path).render([{"role": "assistant", "content": "first"}])


@pytest.mark.parametrize(("source", "words"), [
    ("{{ 10 // (n | default(1)) }}", "ZeroDivisionError"),  # a chat_template_kwargs value the template divides by
    ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError"),  # the sandbox's limit on range
])
def test_whatever_a_template_raises_is_a_chat_template_error_naming_it(tmp_path, source, words):
    write_config(tmp_path, chat_template=source)
    with pytest.raises(ChatTemplateError, match=words):  # before: the bare exception, a 500 from the server
        ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "hi"}], variables={"n": 0})


def test_chat_template_jinja_file_wins_over_the_config(tmp_path):
    write_config(tmp_path, chat_template="from config")
    (tmp_path / "chat_template.jinja").write_text("from file")
    assert ChatTemplate.from_dir(tmp_path).render([]) == "from file"


def test_named_templates_use_the_default_one(tmp_path):
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "tools"},
                                          {"name": "default", "template": "plain"}])
    assert ChatTemplate.from_dir(tmp_path).render([]) == "plain"
    write_config(tmp_path, chat_template=[{"name": ["default"], "template": "x"}])  # a malformed name: no template
    assert ChatTemplate.from_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ChatTemplateError, match="not a JSON object"):
        ChatTemplate.from_dir(tmp_path)


def test_no_template_is_none_and_a_broken_one_says_where(tmp_path):
    write_config(tmp_path)
    assert ChatTemplate.from_dir(tmp_path) is None
    write_config(tmp_path, chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate.from_dir(tmp_path)


def test_the_sandbox_blocks_attribute_escapes(tmp_path):
    write_config(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_dir(tmp_path).render([])


def test_generation_blocks_of_assistant_only_training_render_their_contents_as_transformers_does():
    from transformers.utils.chat_template_utils import render_jinja_template

    source = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>"
              "{% endgeneration %}{% else %}<u>{{ m.content }}</u>{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rendered, _ = render_jinja_template([messages], chat_template=source)
    assert ChatTemplate(source, {}).render(messages) == rendered[0] == "<u>hi</u><a>hello</a>"


@pytest.mark.parametrize(("source", "content_format"), [
    ("{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}", "parts"),
    ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"  # a VLM's, after its system message
     "{% for part in m.content | selectattr('type', 'equalto', 'text') %}{{ part.text }}{% endfor %}{% endfor %}",
     "parts"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"  # Qwen2-VL's: both
     "{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}{% endfor %}", "either"),
], ids=["parts", "parts-after-the-system-message", "string", "either"])
def test_a_template_that_loops_over_content_parts_gets_the_text_as_a_part(source, content_format):
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ChatTemplate(source, {})
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": ""}]
    assert template.content_format == content_format
    assert template.render(messages).endswith("hi")
    parts = [{"role": "system", "content": [{"type": "text", "text": "s"}]},
             {"role": "user", "content": [{"type": "text", "text": "one."}, {"type": "text", "text": "two."}]}]
    rendered = template.render([template_message(message) for message in parts])
    if content_format == "string":  # joined by newlines, as vLLM joins them for a template that takes strings
        assert rendered.endswith("one.\ntwo.")
    else:  # as transformers passes them (and vLLM, for a template that loops over them)
        assert rendered == render_jinja_template([parts], chat_template=source)[0][0] and rendered.endswith("one.two.")


def test_documents_and_reasoning_effort_reach_the_template_under_the_requests_kwargs():
    from types import SimpleNamespace

    from pydantic import ValidationError

    from kiln.runtime.server.chat import render_chat, template_variables
    from kiln.runtime.server.protocol import ChatCompletionRequest

    source = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
              "{{ reasoning_effort | default('-') }} {{ enable_thinking | default('-') }}")
    model = SimpleNamespace(chat_template=ChatTemplate(source, {}))

    def rendered(**fields) -> str:
        request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
        return render_chat(model, request.messages, None, variables=template_variables(request))

    assert rendered() == "- -"
    assert rendered(documents=[{"title": "Kilns", "text": "hot"}], reasoning_effort="low") == "[Kilns: hot]low -"
    assert rendered(reasoning_effort="none") == "none False"
    assert rendered(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == "none True"
    assert rendered(chat_template_kwargs={"documents": [{"title": "A", "text": "b"}]}) == "[A: b]- -"
    with pytest.raises(ValidationError, match="documents"):
        rendered(documents=[{"title": 1}])


def test_a_template_is_read_as_utf_8_whatever_the_locale(tmp_path):
    import subprocess
    import sys

    from tests.subprocess_env import REPO, repo_env

    template = "{% for m in messages %}<｜{{ m.role }}｜>{{ m.content }}{% endfor %}"  # DeepSeek-R1's brackets
    (tmp_path / "chat_template.jinja").write_text(template, encoding="utf-8")
    code = ("import sys; from kiln.runtime.chat_template import ChatTemplate; "
            "sys.stdout.buffer.write(ChatTemplate.from_dir(sys.argv[1]).render([{'role': 'user', 'content': 'hi'}], "
            "add_generation_prompt=False).encode('utf-8'))")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, check=True,
                            env=repo_env(LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONIOENCODING=""))
    assert result.stdout.decode("utf-8") == "<｜user｜>hi"


def test_history_tool_calls_whose_arguments_hold_no_object_reach_the_template_as_an_empty_one(caplog):
    template = ChatTemplate("{% for m in messages %}{% for call in m.tool_calls or [] %}{{ call.function.name }}("
                            "{% for k, v in call.function.arguments | items %}{{ k }}={{ v }}{% endfor %})"
                            "{% endfor %}{% endfor %}", {})  # Qwen3-Coder's and GLM's templates iterate them

    def called(arguments: str) -> str:
        return template.render([template_message({"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]})])

    assert called('{"city": "Oslo"}') == "f(city=Oslo)"
    for cut in ("", '{"city": "Os', "[1]", "null"):  # a call cut off by max_tokens, as Kiln returns one
        assert called(cut) == "f()"  # before: the template failed, and every later turn of the agent with it
    for unreadable in ('{"a":' * 5000 + "1" + "}" * 5000, '{"a": ' + "1" * 5000 + "}"):  # before: a 500
        assert called(unreadable) == "f()"  # json.loads raised RecursionError, or ValueError past 4,300 digits
    assert "no JSON object (12 characters)" in caplog.text and "Os" not in caplog.text  # not the user's text
