"""The server sees the engine only through the LLM's public API (`tokenizer`, `limits`, `check`), and chat prompts
are tokenized as Hugging Face's apply_chat_template tokenizes them (no doubled BOS)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import httpx
import pytest
import tokenizers
from tokenizers import processors

from kiln.runtime import LLM
from kiln.runtime.errors import EngineClosedError
from kiln.runtime.limits import EngineLimits, RequestTooLongError
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.generation import Job, ServedModel, TokenizedPrompt
from kiln.runtime.tokenizer import Tokenizer
from tests.test_server_support import TOKENIZER_SOURCE, tiny_engine

CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}Assistant:"


def public_api_only(limits: EngineLimits, refuse: Exception | None = None) -> SimpleNamespace:
    """An LLM stand-in with only the public accessors the server may use: no `engine` to reach into."""
    def check(prompt, params=None):
        if refuse is not None:
            raise refuse

    return SimpleNamespace(tokenizer=Tokenizer.from_dir(TOKENIZER_SOURCE), limits=limits, check=check)


def test_the_served_model_needs_only_tokenizer_limits_and_check(tmp_path):
    limits = EngineLimits(max_input_len=8, max_seq_len=128, max_batch_size=3, max_num_tokens=64, kv_pool_tokens=100)
    model = ServedModel(public_api_only(limits), "tiny", tmp_path, max_queue=5)
    assert model.admission.capacity == 3 + 5
    assert model.tokenize("Hello there", "prompt") == TokenizedPrompt(model.tokenizer.encode("Hello there"))
    with pytest.raises(APIError, match="at most 8 in the prompt \\(max_input_len\\)"):
        model.tokenize("word " * 20, "prompt")
    assert model.tokenize("word " * 20, "prompt", keep_last=5) == TokenizedPrompt(
        model.tokenizer.encode("word " * 20)[-5:], cut=True)
    with pytest.raises(APIError, match=r"truncate_prompt_tokens \(10\) keeps 10 tokens .* at most 8") as error:
        model.tokenize("word " * 20, "prompt", keep_last=10)  # a cut the engine still cannot take is the cut's fault
    assert error.value.param == "truncate_prompt_tokens"
    assert model.max_tokens(90, None, None, "max_tokens") == 10  # the KV pool, not max_seq_len, bounds this one
    refused = ServedModel(public_api_only(limits, RequestTooLongError("too long for the pool")), "tiny", tmp_path, 5)
    with pytest.raises(APIError, match="too long for the pool") as error:
        refused.check([Job([5, 6], None)], "prompt")
    assert error.value.status_code == 400
    closed = ServedModel(public_api_only(limits, EngineClosedError("the LLM is closed")), "tiny", tmp_path, 5)
    with pytest.raises(APIError, match="the engine is not serving") as error:
        closed.check([Job([5, 6], None)], "prompt")
    assert error.value.status_code == 503 and error.value.headers == {"Retry-After": "1"}


@pytest.fixture(scope="module")
def bos_engine(tmp_path_factory):
    """The tiny test engine with a Llama-style tokenizer that adds BOS itself (a TemplateProcessing post-processor),
    served over HTTP; the test writes its chat_template.jinja."""
    engine = shutil.copytree(tiny_engine(), tmp_path_factory.mktemp("bos") / "engine")
    tokenizer = tokenizers.Tokenizer.from_file(str(engine / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.save(str(engine / "tokenizer.json"))
    config = json.loads((engine / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (engine / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    return engine


@pytest.mark.parametrize("template", ["{{ bos_token }}" + CHAT, CHAT], ids=["template-writes-bos", "no-bos"])
def test_chat_prompts_get_exactly_the_tokens_transformers_apply_chat_template_gives(bos_engine, template):
    from transformers import AutoTokenizer

    (bos_engine / "chat_template.jinja").write_text(template)
    messages = [{"role": "user", "content": "Hi there"}]
    expected = AutoTokenizer.from_pretrained(bos_engine).apply_chat_template(messages, tokenize=True,
                                                                              add_generation_prompt=True)["input_ids"]
    assert expected.count(0) == template.count("bos_token")  # one BOS when the template writes it, else none
    with LLM.load(bos_engine) as llm:
        assert llm.tokenizer.encode("Hi")[:2] == [0, llm.tokenizer.encode("Hi", add_special_tokens=False)[0]]
        with ServerThread(create_app(llm, bos_engine, ServerSettings(model_name="tiny"))) as server:
            response = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                                  json={"messages": messages, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_each_server_warns_once_of_an_ignored_field_whatever_other_servers_in_the_process_did(tmp_path, caplog):
    from kiln.runtime.server.jobs import make_jobs
    from kiln.runtime.server.protocol import CompletionRequest

    limits = EngineLimits(max_input_len=8, max_seq_len=128, max_batch_size=3, max_num_tokens=64, kv_pool_tokens=100)
    request = CompletionRequest(model="tiny", prompt="hi", user="u-1")
    for model in [ServedModel(public_api_only(limits), "tiny", tmp_path, 5) for _ in range(2)]:  # two apps, say
        caplog.clear()
        for _ in range(2):
            make_jobs(model, request, [[5]], [4], logprobs=None, prompt_logprobs=None, structured_output=None)
        assert [r.getMessage() for r in caplog.records].count(
            "requests set 'user', which this server accepts and ignores (logged once)") == 1
