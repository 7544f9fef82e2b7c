"""Where Mistral's ``[TOOL_CALLS]`` is a special token, a chat request that may call tools keeps special tokens in
its text (``skip_special_tokens`` off, as vLLM's mistral parser turns it off), so that calls after content are found
at the marker; other formats and requests that call nothing decode as asked."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import tokenizers

from kiln.runtime.limits import EngineLimits
from kiln.runtime.server.chat import prepare_chat
from kiln.runtime.server.generation import ServedModel
from kiln.runtime.server.protocol import ChatCompletionRequest
from kiln.runtime.server.tool_calls import MISTRAL
from kiln.runtime.tokenizer import Tokenizer
from tests.test_server_support import TOKENIZER_SOURCE
from tests.test_server_tools import CLOCK, HERMES_TEMPLATE, MESSAGES, MISTRAL_TEMPLATE


def tokenizer(marker_is_special: bool) -> Tokenizer:
    """The tiny tokenizer with ``[TOOL_CALLS]`` added, as a special token (Mistral's) or as plain text."""
    inner = tokenizers.Tokenizer.from_file(str(TOKENIZER_SOURCE / "tokenizer.json"))
    added = tokenizers.AddedToken("[TOOL_CALLS]", special=marker_is_special)
    inner.add_special_tokens([added]) if marker_is_special else inner.add_tokens([added])
    return Tokenizer(inner)


def skips_special_tokens(tmp_path, template: str, marker_is_special: bool = True, **fields) -> bool:
    limits = EngineLimits(max_input_len=512, max_seq_len=1024, max_batch_size=4, max_num_tokens=512,
                          kv_pool_tokens=4096)
    llm = SimpleNamespace(tokenizer=tokenizer(marker_is_special), limits=limits, check=lambda *args: None)
    model = ServedModel(llm, "tiny", tmp_path, max_queue=4, chat_template=template)
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "max_tokens": 8, **fields})
    return asyncio.run(prepare_chat(model, request)).jobs[0].params.skip_special_tokens


def test_a_mistral_request_that_may_call_tools_keeps_the_special_marker_in_its_text(tmp_path):
    assert MISTRAL.parse('Sure, one moment.[TOOL_CALLS] [{"name": "get_time", "arguments": {}}] Done.',
                         {"get_time"})[1][0].name == "get_time"  # what the kept marker lets the parser find
    assert not skips_special_tokens(tmp_path, MISTRAL_TEMPLATE, tools=[CLOCK])  # before: skipped, calls lost
    assert not skips_special_tokens(tmp_path, MISTRAL_TEMPLATE, tools=[CLOCK], tool_choice="required")


@pytest.mark.parametrize(("template", "special", "fields"), [
    (MISTRAL_TEMPLATE, True, {}),  # no tools
    (MISTRAL_TEMPLATE, True, {"tools": [CLOCK], "tool_choice": "none"}),
    (MISTRAL_TEMPLATE, False, {"tools": [CLOCK]}),  # the marker is text: nothing to keep
    (HERMES_TEMPLATE, True, {"tools": [CLOCK]}),
], ids=["no-tools", "tool-choice-none", "marker-as-text", "hermes"])
def test_other_requests_decode_special_tokens_as_asked(tmp_path, template, special, fields):
    assert skips_special_tokens(tmp_path, template, special, **fields)
    assert not skips_special_tokens(tmp_path, template, special, skip_special_tokens=False, **fields)
