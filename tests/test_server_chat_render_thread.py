"""A long conversation is rendered through the chat template on a worker thread, so that the event loop serves other
requests meanwhile (99,000 short messages had held every stream and /health for over half a second); a short one
is rendered on the loop, where a thread would cost more than the render."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import tokenizers

from kiln.runtime.limits import EngineLimits
from kiln.runtime.server import chat
from kiln.runtime.server.generation import ServedModel
from kiln.runtime.server.protocol import ChatCompletionRequest
from kiln.runtime.tokenizer import Tokenizer
from tests.test_server_support import TOKENIZER_SOURCE


def test_a_long_conversation_is_rendered_off_the_event_loop_and_a_short_one_on_it(tmp_path, monkeypatch):
    limits = EngineLimits(max_input_len=4096, max_seq_len=8192, max_batch_size=4, max_num_tokens=4096,
                          kv_pool_tokens=8192)
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_file(str(TOKENIZER_SOURCE / "tokenizer.json")))
    llm = SimpleNamespace(tokenizer=tokenizer, limits=limits, check=lambda *args: None)
    model = ServedModel(llm, "tiny", tmp_path, max_queue=4, chat_template="{% for m in messages %}{{ m.content }}"
                                                                           "{% endfor %}")
    threads, render = [], chat.render_chat

    def recorded(*args, **kwargs) -> str:
        threads.append(threading.current_thread())
        return render(*args, **kwargs)

    monkeypatch.setattr(chat, "render_chat", recorded)
    for count in (2, 1000):
        request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}] * count,
                                                        "max_tokens": 1})
        assert tokenizer.decode(asyncio.run(chat.prepare_chat(model, request)).prompt) == "hi" * count
    assert threads == [threading.main_thread(), threads[1]] and threads[1] is not threading.main_thread()
