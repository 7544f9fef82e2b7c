"""A chat history's tool results answer the calls of the assistant message right before them (OpenAI's rule), and a
history with tool calls is refused by a chat template that would leave the calls out of the prompt."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from kiln.runtime.chat_template import ChatTemplate
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from kiln.runtime.server.chat import render_chat
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.protocol import ChatCompletionRequest
from tests.test_server_support import tiny_engine

USER = {"role": "user", "content": "hi"}


def called(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": f"tool_{i}", "arguments": "{}"}} for i in ids]}


def result(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "r"}


def render(template: str, messages: list[dict], **kwargs) -> str:
    model = SimpleNamespace(name="tiny", chat_template=ChatTemplate(template, {"eos_token": "</s>"}))
    req = ChatCompletionRequest.model_validate({"messages": messages})
    return render_chat(model, req.messages, None, **kwargs)


REFUSED = [  # the history, the param named, words of the message
    ([USER, called("call_1", "call_2"), result("call_zzz")], "messages[2].tool_call_id",
     "No tool call found for tool message with tool_call_id 'call_zzz'"),
    ([USER, result("zz")], "messages[1]", "must answer a preceding assistant message with tool_calls"),
    ([USER, called("a"), result("a"), USER, result("a")], "messages[4]", "must answer a preceding"),
]


def test_a_tool_message_answers_a_call_right_before_it_and_calls_may_go_without_a_result():
    for messages, param, words in REFUSED:  # before: each rendered as if it answered
        with pytest.raises(APIError) as refused:
            render("{{ messages | tojson }}", messages)
        assert refused.value.status_code == 400 and refused.value.param == param and words in refused.value.message
    taken = [USER, called("a", "b"), result("b"), result("a"), called("c", "d"), result("c")]  # d: no result
    assert len(json.loads(render("{{ messages | tojson }}", taken, add_generation_prompt=False))) == 6


def test_a_template_that_leaves_tool_calls_out_refuses_a_history_with_them_on_chat_and_tokenize(llm):
    history = [USER, called("a"), result("a")]
    app = create_app(llm, tiny_engine(), ServerSettings(model_name="tiny"))  # the bundled template renders no calls
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        responses = [http.post("/tokenize", json={"model": "tiny", "messages": history}),
                     http.post("/v1/chat/completions", json={"model": "tiny", "messages": history, "max_tokens": 1})]
        continued = http.post("/tokenize", json={"model": "tiny", "messages": [USER, {**called("a"), "content": "x"}],
                                                 "add_generation_prompt": False, "continue_final_message": True})
    for response in responses:  # before: a 200, the prompt "User: hi\nAssistant: </s>Tool: r\nAssistant:"
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages[1].tool_calls" and "does not render tool calls" in error["message"]
    assert continued.status_code == 200, continued.text  # a continued message's calls are cut off anyway
