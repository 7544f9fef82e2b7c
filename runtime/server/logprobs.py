"""Log probabilities in OpenAI's response shapes: chat's ``logprobs.content`` entries, the legacy completions
lists (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

from kiln.runtime.outputs import TokenLogprob
from kiln.runtime.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from kiln.runtime.tokenizer import Tokenizer


class TokenText:
    """A token id as OpenAI's logprobs name it: its text (bytes that end inside a character decode with U+FFFD, the
    exact bytes being in ``bytes``), or ``token_id:N`` for an engine without a tokenizer (as vLLM writes it)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def bytes_of(self, token_id: int) -> bytes | None:
        return self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else None

    def text(self, token_id: int) -> str:
        value = self.bytes_of(token_id)
        return f"token_id:{token_id}" if value is None else value.decode("utf-8", errors="replace")

    def top(self, token_id: int, logprob: float) -> TopLogprob:
        value = self.bytes_of(token_id)
        return TopLogprob(token=self.text(token_id), logprob=logprob, bytes=None if value is None else list(value))


def chat_logprobs(names: TokenText, entries: list[TokenLogprob]) -> ChatLogprobs:
    """``choices[].logprobs`` of a chat completion (or of one streamed chunk's tokens)."""
    content = []
    for entry in entries:
        top = names.top(entry.token_id, entry.logprob)
        content.append(ChatTokenLogprob(token=top.token, logprob=top.logprob, bytes=top.bytes,
                                        top_logprobs=[names.top(t, lp) for t, lp in entry.top]))
    return ChatLogprobs(content=content)


def completion_logprobs(names: TokenText, entries: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """The legacy completions lists over ``entries``, the first token at character ``text_offset`` of the choice's
    text."""
    result = CompletionLogprobs()
    for entry in entries:
        token = names.text(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append({names.text(t): lp for t, lp in entry.top})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def echoed_logprobs(names: TokenText, prompt_token_ids: list[int], entries: list[TokenLogprob | None],
                    text_offset: int = 0) -> CompletionLogprobs:
    """The legacy lists over an echoed prompt: its first token with a null log probability (no context), then the
    other prompt tokens' ``entries`` (``entries[0]`` is that first token's None)."""
    first = names.text(prompt_token_ids[0])
    head = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[text_offset])
    return head.extend(completion_logprobs(names, entries[1:], text_offset + len(first)))


def vllm_prompt_logprobs(names: TokenText, entries: list[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), its id and the top ids, each with
    ``logprob`` and ``decoded_token``."""
    result: list[dict | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        pairs = [(entry.token_id, entry.logprob), *((t, lp) for t, lp in entry.top if t != entry.token_id)]
        result.append({str(t): {"logprob": lp, "decoded_token": names.text(t)} for t, lp in pairs})
    return result
