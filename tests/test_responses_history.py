"""A Responses input's history becomes the chat messages it was: a reasoning item no assistant message follows keeps
a turn of its own (a response cut off while it thought), and a call's output must come after its call."""

from __future__ import annotations

import pytest

from kiln.runtime.server.errors import APIError
from kiln.runtime.server.responses import chat_request
from kiln.runtime.server.responses_protocol import ResponsesRequest

THOUGHT = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]}
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}


def messages(items: list[dict]) -> list[dict]:
    request = chat_request(ResponsesRequest.model_validate({"model": "m", "input": items}))
    return [message.model_dump(exclude_none=True) for message in request.messages]


def test_a_thought_no_answer_followed_keeps_its_own_turn_and_never_joins_a_later_answer():
    history = messages([{"role": "user", "content": "Q1"}, THOUGHT, {"role": "user", "content": "Q2"},
                        {"role": "assistant", "content": "A2"}, {"role": "user", "content": "Q3"}])
    assert [(m["role"], m.get("content"), m.get("reasoning_content")) for m in history] == [
        ("user", "Q1", None), ("assistant", "", "Hmm."), ("user", "Q2", None), ("assistant", "A2", None),
        ("user", "Q3", None)]  # before: "Hmm." was A2's reasoning
    assert messages([{"role": "user", "content": "Q1"}, THOUGHT]) == [{"role": "user", "content": "Q1"}]  # at the
    # end, no assistant turn before the answer's own
    answered = messages([{"role": "user", "content": "Q1"}, THOUGHT, {"role": "assistant", "content": "A1"}])
    assert answered[-1]["reasoning_content"] == "Hmm." and answered[-1]["content"] == "A1"


def test_a_call_output_before_its_call_is_a_400_naming_it():
    output = {"type": "function_call_output", "call_id": "c1", "output": "x"}
    with pytest.raises(APIError) as refused:
        messages([{"role": "user", "content": "Q"}, output, CALL])
    assert refused.value.param == "input[1]" and "before its output" in refused.value.message
    assert [m["role"] for m in messages([{"role": "user", "content": "Q"}, CALL, output])] == [
        "user", "assistant", "tool"]
