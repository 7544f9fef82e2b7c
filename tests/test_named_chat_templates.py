"""Named chat templates (Hermes-2-Pro's and Command-R's ``default`` and ``tool_use``, in tokenizer_config.json or
transformers 5's ``chat_template.jinja`` and ``additional_chat_templates/``): a request with tools renders the
``tool_use`` one and one without the default, as transformers' ``apply_chat_template`` (the oracle) and vLLM pick
them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from kiln import ChatInputError
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.chat_template import ChatTemplate, ChatTemplateError
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from kiln.runtime.tokenizer_files import copy_tokenizer_files
from tests.test_server_support import TOKENIZER_SOURCE, tiny_engine

MODEL = "tiny"
TOOL_USE = """{{ bos_token }}<|im_start|>system
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


def default_template() -> str:
    return json.loads((TOKENIZER_SOURCE / "tokenizer_config.json").read_text())["chat_template"]  # renders no tools


def write_named(directory: Path, layout: str, templates: dict[str, str]) -> Path:
    """``directory``'s templates as ``templates`` by name: in tokenizer_config.json ("config") or in transformers 5's
    files ("jinja", as its save_pretrained writes them)."""
    config = json.loads((TOKENIZER_SOURCE / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": name, "template": text} for name, text in templates.items()]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if layout == "jinja":
        from transformers import AutoTokenizer

        shutil.copyfile(TOKENIZER_SOURCE / "tokenizer.json", directory / "tokenizer.json")
        AutoTokenizer.from_pretrained(directory).save_pretrained(directory)
        assert "chat_template" not in json.loads((directory / "tokenizer_config.json").read_text())
    return directory


def oracle(directory: Path, messages: list[dict], **kwargs) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory).apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("layout", ["config", "jinja"])
def test_tools_render_the_tool_use_template_and_no_tools_the_default_as_transformers_does(tmp_path, layout):
    shutil.copyfile(TOKENIZER_SOURCE / "tokenizer.json", tmp_path / "tokenizer.json")
    write_named(tmp_path, layout, {"default": default_template(), "tool_use": TOOL_USE})
    template = ChatTemplate.from_dir(tmp_path)
    assert template.render(MESSAGES, tools=[WEATHER]) == oracle(tmp_path, MESSAGES, tools=[WEATHER],
                                                                add_generation_prompt=True)
    assert template.render(MESSAGES) == oracle(tmp_path, MESSAGES, add_generation_prompt=True) == \
        "User: Weather in Oslo?\nAssistant:"
    assert template.for_tools([WEATHER]).source == TOOL_USE and template.source == default_template()
    assert ChatTemplate.from_dir(tmp_path, source="default").render(MESSAGES, tools=[WEATHER]) == \
        oracle(tmp_path, MESSAGES, chat_template="default", tools=[WEATHER], add_generation_prompt=True)  # by name


@pytest.mark.parametrize("layout", ["config", "jinja"])
def test_named_templates_without_a_default_render_only_with_tools_as_transformers_does(tmp_path, layout):
    shutil.copyfile(TOKENIZER_SOURCE / "tokenizer.json", tmp_path / "tokenizer.json")
    write_named(tmp_path, layout, {"tool_use": TOOL_USE})
    template = ChatTemplate.from_dir(tmp_path)
    assert template.render(MESSAGES, tools=[WEATHER]) == oracle(tmp_path, MESSAGES, tools=[WEATHER],
                                                                add_generation_prompt=True)
    with pytest.raises(ValueError, match="no default specified"):
        oracle(tmp_path, MESSAGES)
    with pytest.raises(ChatTemplateError, match="named 'default'"):
        template.render(MESSAGES)
    other = tmp_path / "rag"
    other.mkdir()
    write_named(other, "config", {"rag": "x"})  # neither a default nor tool_use: nothing renders
    with pytest.raises(ChatTemplateError, match=r"\(rag\) is named 'default'"):
        ChatTemplate.from_dir(other)


RENDERS_CALLS = TOOL_USE.replace("{{ m.content }}", "{{ m.content }}{% for c in m.tool_calls or [] %}"
                                                   "<tool_call>{{ c.function.name }}</tool_call>{% endfor %}")


def test_a_tool_history_sent_without_tools_renders_the_tool_use_template(tmp_path):
    """The default template of such a model (Hermes') leaves tool calls out: a history that holds them, sent
    without tools (a last turn with tools off), renders through tool_use (it had been refused as dropping them)."""
    from kiln.runtime.conversations import render_prompts
    from kiln.runtime.tokenizer import Tokenizer

    shutil.copyfile(TOKENIZER_SOURCE / "tokenizer.json", tmp_path / "tokenizer.json")
    write_named(tmp_path, "config", {"default": default_template(), "tool_use": RENDERS_CALLS})
    template = ChatTemplate.from_dir(tmp_path)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    history = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "Sum up"}]
    text, dropped = template.render_with_calls(history)
    assert "<tool_call>get_weather</tool_call>" in text and dropped is None
    assert template.render_with_calls(MESSAGES) == ("User: Weather in Oslo?\nAssistant:", None)  # the default
    [(rendered, _)] = render_prompts([history], template, Tokenizer.from_dir(tmp_path), add_generation_prompt=True,
                                     continue_final_message=False, tools=None, chat_template_kwargs=None)
    assert rendered == text  # LLM.chat's path
    calls = "{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}[{{ c.function.name }}]{% endfor %}"
    write_named(tmp_path, "config", {"default": calls + "{% endfor %}", "tool_use": TOOL_USE})
    renders_them = ChatTemplate.from_dir(tmp_path)  # a default that renders the calls stays the one, as transformers
    assert renders_them.render_with_calls(history) == ("Weather in Oslo?[get_weather]sunnySum up", None)


def test_an_engine_build_keeps_the_named_template_files(tmp_path):
    checkpoint = write_named(tmp_path, "jinja", {"default": default_template(), "tool_use": TOOL_USE})
    (tmp_path / "engine").mkdir()
    copy_tokenizer_files(checkpoint, tmp_path / "engine")
    assert (tmp_path / "engine" / "additional_chat_templates" / "tool_use.jinja").read_text() == TOOL_USE
    assert ChatTemplate.from_dir(tmp_path / "engine").for_tools([WEATHER]).source == TOOL_USE


def test_named_template_files_travel_through_quantization_key_the_build_and_teach_the_tool_call_parser(tmp_path):
    from kiln.calibration.export import copy_tokenizer_files as copy_to_quantized
    from kiln.engines.cache.hashing import checkpoint_hash
    from kiln.pipeline.serve_flags import check_tool_call_parser

    checkpoint = write_named(tmp_path, "jinja", {"default": default_template(), "tool_use": TOOL_USE})
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    before = checkpoint_hash(checkpoint)
    (checkpoint / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE + " ")
    assert checkpoint_hash(checkpoint) != before  # an edited tool_use template is another engine
    (tmp_path / "quantized").mkdir()
    copy_to_quantized(checkpoint, tmp_path / "quantized")
    assert (tmp_path / "quantized" / "additional_chat_templates" / "tool_use.jinja").is_file()
    check_tool_call_parser("hermes", None, checkpoint)  # Hermes-2-Pro's: its tool_use template teaches hermes


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    """The tiny engine, its templates named (in tokenizer_config.json) default and tool_use."""
    engine = tmp_path_factory.mktemp("named") / "engine"
    shutil.copytree(tiny_engine(max_seq_len=1024, max_input_len=896), engine)
    return write_named(engine, "config", {"default": default_template(), "tool_use": TOOL_USE})


@pytest.fixture(scope="module")
def llm(engine):
    with LLM.load(engine) as llm:
        yield llm


def test_llm_chat_with_tools_renders_the_tool_use_template(llm, engine):
    greedy = SamplingParams(temperature=0, max_tokens=2)
    [with_tools] = llm.chat(MESSAGES, greedy, tools=[WEATHER])
    assert with_tools.prompt == oracle(engine, MESSAGES, tools=[WEATHER], add_generation_prompt=True)
    [plain] = llm.chat(MESSAGES, greedy)
    assert plain.prompt == oracle(engine, MESSAGES, add_generation_prompt=True)
    with pytest.raises(ChatInputError, match="does not render tools"):  # a template given replaces them both
        llm.chat(MESSAGES, greedy, tools=[WEATHER], chat_template=default_template())


def test_the_server_renders_and_parses_tools_through_the_tool_use_template(llm, engine):
    with ServerThread(create_app(llm, engine, ServerSettings(model_name=MODEL))) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        tokenized = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": [WEATHER]}).json()
        text = oracle(engine, MESSAGES, tools=[WEATHER], add_generation_prompt=True)
        assert tokenized["tokens"] == llm.tokenizer.encode(text, add_special_tokens=False)
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "tools": [WEATHER],
                                                       "tool_choice": "required", "max_tokens": 60, "seed": 1}).json()
        [call] = chat["choices"][0]["message"]["tool_calls"]  # forced in the Hermes format tool_use teaches
        assert call["function"]["name"] == "get_weather"
        assert http.get("/tokenizer_info").json()["chat_template"] == default_template()
    given = ServerSettings(model_name=MODEL, chat_template=default_template())  # --chat-template replaces them both
    with ServerThread(create_app(llm, engine, given)) as server, httpx.Client(base_url=server.url) as http:
        refused = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": [WEATHER]})
        assert refused.status_code == 400 and "does not render tools" in refused.text
