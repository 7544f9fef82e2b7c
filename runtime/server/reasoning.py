"""A reasoning model's thinking apart from its answer (vLLM's ``--reasoning-parser``): the text between ``<think>``
and ``</think>`` becomes the message's ``reasoning`` (and ``reasoning_content``, its older name), the rest its
content. vLLM's ``qwen3`` and ``deepseek_r1`` parsers read the same tags; here one reader serves both, and whether the
completion starts inside a thought is read from the prompt, so that every template is read right:

- Qwen3 with thinking on: the model opens ``<think>`` itself.
- Qwen3 with ``enable_thinking: false``: the prompt holds an empty, closed thought; the completion is answer
  unless it opens a thought itself (as vLLM's qwen3 parser reads it).
- DeepSeek-R1, QwQ and Qwen3 "Thinking-2507": the prompt ends inside ``<think>``; the completion thinks until
  ``</think>`` (a ``<think>`` it writes first all the same is dropped, as vLLM's deepseek_r1 parser drops it).
- ``deepseek_r1`` with a prompt that names no thought (R1's first templates, and fine-tunes of them): the
  completion thinks until ``</think>`` all the same, as vLLM's parser reads it, since R1 may not write ``<think>``.

A completion that ends before ``</think>`` (cut off by ``max_tokens``) is all reasoning. The answer is sent without
the whitespace that separates it from the thought. A completion that a grammar writes (a forced tool call,
``response_format``, ``structured_outputs``) holds no thought the prompt opened: the grammar writes the answer from
its first token.
"""

from __future__ import annotations

from kiln.runtime.server.partial_tags import partial_tag_length

REASONING_PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names of the parsers this reader stands for
THINK_START, THINK_END = "<think>", "</think>"


def thinking_at_start(generation_prompt: str, parser: str) -> bool:
    """Whether a completion starts inside a thought: ``generation_prompt`` (what the template adds to the messages
    for the answer; a ``<think>`` quoted in a message does not count) opens one it does not close, or, for
    ``deepseek_r1``, names no thought at all."""
    opened, closed = generation_prompt.rfind(THINK_START), generation_prompt.rfind(THINK_END)
    return opened > closed or (parser == "deepseek_r1" and opened == closed == -1)


class ReasoningSplitter:
    """One choice's completion, fed as it streams, split into reasoning and answer text: each ``feed`` returns what
    it lets go out of each (a possible start of a tag is held back until the next delta shows what it is)."""

    def __init__(self, thinking: bool) -> None:
        # undecided: the completion may yet open <think>; opening: it is in a thought, and may write <think> again
        self.mode = "opening" if thinking else "undecided"
        self.held = ""  # text not yet sent: a possible start of a tag
        self.after_thought = False  # the answer follows a thought: the whitespace before it is dropped

    @property
    def thought_over(self) -> bool:
        """Whether the completion is past its thought (or never had one): no more reasoning will come."""
        return self.mode == "answer"

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """The reasoning and the answer text that ``text`` (the next piece of the completion) lets go out; on the
        last piece (``finished``) everything held."""
        self.held += text
        reasoning = ""
        if self.mode in ("undecided", "opening"):
            stripped = self.held.lstrip()
            if stripped.startswith(THINK_START):
                self.mode, self.held = "reasoning", stripped[len(THINK_START):]
            elif THINK_START.startswith(stripped) and not finished:
                return "", ""
            else:
                self.mode = "reasoning" if self.mode == "opening" else "answer"
        if self.mode == "reasoning":
            if (end := self.held.find(THINK_END)) >= 0:
                reasoning, self.held, self.mode = self.held[:end], self.held[end + len(THINK_END):], "answer"
                self.after_thought = True
            else:
                keep = 0 if finished else partial_tag_length(self.held, THINK_END)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return reasoning, ""
        answer, self.held = self.held, ""
        if self.after_thought:
            answer = answer.lstrip()
            self.after_thought = not answer
        return reasoning, answer


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str, bool]:
    """A whole completion's reasoning (None when it has none), answer, and whether its thought ended (or it had
    none)."""
    splitter = ReasoningSplitter(thinking)
    reasoning, answer = splitter.feed(text, finished=True)
    return reasoning or None, answer, splitter.thought_over
