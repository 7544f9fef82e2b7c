"""What one request may ask of a loaded engine: its build plan's bounds and the size of its KV pool."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.plan import BuildPlan
from kiln.runtime.sampling_params import ONE_COMPLETION, SamplingParams


class RequestTooLongError(InvalidRequestError):
    """A request that this engine can never serve (too long for its plan or its KV pool): an invalid request, so
    ``except InvalidRequestError`` catches it too."""


@dataclass(frozen=True)
class EngineLimits:
    """The bounds an engine was built for (`max_input_len`, `max_seq_len`, `max_batch_size`, `max_num_tokens`), how
    many tokens its paged KV pool holds (`kv_pool_tokens`; None when the backend sizes the pool itself), and the
    vocabulary a prompt's token ids come from (`vocab_size`)."""

    max_input_len: int
    max_seq_len: int
    max_batch_size: int
    max_num_tokens: int
    kv_pool_tokens: int | None = None
    vocab_size: int | None = None

    @classmethod
    def from_plan(cls, plan: BuildPlan, *, vocab_size: int | None = None,
                  kv_pool_tokens: int | None = None) -> EngineLimits:
        """The limits of an engine's build plan and vocabulary, with the size of its KV pool when the engine knows
        it."""
        return cls(max_input_len=plan.max_input_len, max_seq_len=plan.max_seq_len, max_batch_size=plan.max_batch_size,
                   max_num_tokens=plan.max_num_tokens, kv_pool_tokens=kv_pool_tokens, vocab_size=vocab_size)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt plus generated) one request can hold: `max_seq_len`, or less if the KV pool is
        smaller."""
        return self.max_seq_len if self.kv_pool_tokens is None else min(self.max_seq_len, self.kv_pool_tokens)

    def taken(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """The params a request of this size runs with (``max_tokens`` None: what the context leaves after the
        prompt, as in vLLM), checked by ``check_request``."""
        if params.max_tokens is None:
            room = self.max_request_tokens - num_prompt_tokens
            if num_prompt_tokens and room < 1:
                raise RequestTooLongError(f"prompt ({num_prompt_tokens} tokens) leaves no room to generate in the "
                                          f"engine's {self.max_request_tokens} tokens: shorten the prompt")
            params = replace(params, max_tokens=max(room, 1))
        self.check_request(num_prompt_tokens, params)
        return params

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise RequestTooLongError unless a request of this size can be served, InvalidRequestError when its
        parameters name a token id outside the vocabulary."""
        max_tokens = params.max_tokens
        if params.n != 1:
            raise InvalidRequestError(f"SamplingParams.n is {params.n}: {ONE_COMPLETION}")
        if num_prompt_tokens == 0:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if num_prompt_tokens > self.max_input_len:
            raise RequestTooLongError(f"prompt has {num_prompt_tokens} tokens but the engine's max_input_len is "
                                      f"{self.max_input_len}: shorten the prompt or rebuild with a larger "
                                      f"max_input_len")
        total = num_prompt_tokens + max_tokens
        if total > self.max_seq_len:
            raise RequestTooLongError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                                      f"exceeds the engine's max_seq_len ({self.max_seq_len}): shorten the prompt or "
                                      f"lower max_tokens")
        if self.kv_pool_tokens is not None and total > self.kv_pool_tokens:
            raise RequestTooLongError(f"request of {total} tokens does not fit the KV pool of {self.kv_pool_tokens} "
                                      f"tokens: lower max_tokens or load with more num_kv_blocks")
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            if outside := outside_vocabulary(getattr(params, name) or (), self.vocab_size):
                raise InvalidRequestError(f"token ids {outside[:8]} (in {name}) are outside the vocabulary of "
                                          f"{self.vocab_size} tokens: send ids below {self.vocab_size}")


def outside_vocabulary(token_ids: Iterable[int], vocab_size: int | None) -> list[int]:
    """The ids of ``token_ids`` (a list, or a dict's keys) at or above ``vocab_size``, sorted; none when the size is
    unknown. One max() over them decides first, so ids all within it cost no call per id."""
    if vocab_size is None or not token_ids or max(token_ids) < vocab_size:
        return []
    return sorted(t for t in token_ids if t >= vocab_size)
