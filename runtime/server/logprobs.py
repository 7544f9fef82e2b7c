"""Log probabilities in OpenAI's response shapes: chat's ``logprobs.content`` entries, the legacy completions
lists (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import dataclasses

from kiln.runtime.outputs import TokenLogprob
from kiln.runtime.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from kiln.runtime.tokenizer import IncrementalDetokenizer, Tokenizer


class TokenText:
    """A token id as OpenAI's logprobs name it: its text (bytes that end inside a character decode with U+FFFD, the
    exact bytes being in ``bytes``), or ``token_id:N`` for an engine without a tokenizer (as vLLM writes it) and
    with ``as_ids`` (vLLM's ``return_tokens_as_token_ids``: ``bytes`` then spell that name, as vLLM's do)."""

    def __init__(self, tokenizer: Tokenizer | None, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def bytes_of(self, token_id: int) -> bytes | None:
        if self.as_ids:
            return f"token_id:{token_id}".encode()
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


class TextOffsets:
    """Where each token of a choice's text starts in it (the legacy ``text_offset``): the length of what the tokens
    before it decode to in whole characters, grown as the engine grows a completion's text, so a token that ends
    inside a character adds none of it and the next one starts at that character too."""

    def __init__(self, tokenizer: Tokenizer | None, context: list[int], start: int = 0,
                 skip_special_tokens: bool = True) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, context, [], skip_special_tokens=skip_special_tokens) \
            if tokenizer is not None else None
        self._start = start

    def take(self, token_ids: list[int]) -> list[int]:
        """The offsets of the next ``token_ids``."""
        if self._detokenizer is None:  # no tokenizer, no text: every token at the start
            return [self._start] * len(token_ids)
        offsets = []
        for token_id in token_ids:
            offsets.append(self._start + len(self._detokenizer.text) + self._detokenizer.characters_before(token_id))
            self._detokenizer.add_token(token_id)
        return offsets


def top_k(entries: list[TokenLogprob | None], k: int) -> list[TokenLogprob | None]:
    """``entries`` with at most ``k`` alternatives each (the engine gives the larger ``k`` of two that one request
    asks for)."""
    return [entry if entry is None else dataclasses.replace(entry, top=entry.top[:k]) for entry in entries]


def completion_logprobs(names: TokenText, entries: list[TokenLogprob], text_offsets: list[int]) -> CompletionLogprobs:
    """The legacy completions lists over ``entries``, which start at ``text_offsets`` in the choice's text; each
    position's ``top_logprobs`` hold the chosen token too (up to ``logprobs`` + 1 entries, as OpenAI documents). Two
    tokens of one text (pieces of characters both read U+FFFD) share its key with the likelier one's value, so that a
    harness comparing the chosen token's value with the largest finds whether it was greedy."""
    result = CompletionLogprobs(text_offset=list(text_offsets))
    for entry in entries:
        token = names.text(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        top: dict[str, float] = {}
        for token_id, logprob in sorted([*entry.top, (entry.token_id, entry.logprob)], key=lambda pair: -pair[1]):
            top.setdefault(names.text(token_id), logprob)
        result.top_logprobs.append(top)
    return result


def echoed_logprobs(names: TokenText, prompt_token_ids: list[int], entries: list[TokenLogprob | None],
                    text_offsets: list[int]) -> CompletionLogprobs:
    """The legacy lists over an echoed prompt whose tokens start at ``text_offsets``: its first token with a null
    log probability (no context), then the other prompt tokens' ``entries`` (``entries[0]`` is that first token's
    None)."""
    head = CompletionLogprobs(tokens=[names.text(prompt_token_ids[0])], token_logprobs=[None], top_logprobs=[None],
                              text_offset=text_offsets[:1])
    return head.extend(completion_logprobs(names, entries[1:], text_offsets[1:]))


def vllm_prompt_logprobs(names: TokenText, entries: list[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), its id and the top ids, each with
    ``logprob``, ``rank`` (the top ids ranked 1.. in order) and ``decoded_token``."""
    result: list[dict | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        ranked = [(entry.token_id, entry.logprob, entry.rank),
                  *((t, lp, rank) for rank, (t, lp) in enumerate(entry.top, start=1) if t != entry.token_id)]
        result.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": names.text(t)} for t, lp, rank in ranked})
    return result
