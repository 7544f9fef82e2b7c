"""What a request gives back: the final output, the streamed deltas, and latency metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from kiln.runtime.attribute_hints import hinted_attribute
from kiln.runtime.errors import KilnError

if TYPE_CHECKING:
    from kiln.runtime.sequence import Sequence
    from kiln.runtime.tokenizer import IncrementalDetokenizer


@dataclass
class RequestMetrics:
    """Latencies in seconds, on the `time.monotonic()` clock."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    inter_token_latencies: list[float] = field(default_factory=list, repr=False)  # one a token: too long to show
    first_scheduled_time: float | None = None  # None where the engine's scheduler does not report it

    @classmethod
    def from_sequence(cls, seq: Sequence) -> RequestMetrics:
        return cls(arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
                   finished_time=seq.finished_time, num_prompt_tokens=seq.num_prompt_tokens,
                   num_cached_tokens=seq.num_cached_tokens, num_generated_tokens=seq.num_completion_tokens,
                   num_preemptions=seq.num_preemptions, inter_token_latencies=list(seq.inter_token_latencies),
                   first_scheduled_time=seq.first_scheduled_time)

    @property
    def queue_time(self) -> float | None:
        """From arrival to the first admission into the running batch."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """From the first admission to the first token."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """From the first token to the last."""
        if self.first_token_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_token_time

    @property
    def inference_time(self) -> float | None:
        """From the first admission to the last token."""
        if self.first_scheduled_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_scheduled_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


# what vLLM's code reads of a position's logprobs (a dict of token id to Logprob), and what TokenLogprob has instead
TOKEN_LOGPROB_FIELDS = ("this position's token is .token_id, with .logprob and .rank; the alternatives are .top, "
                        "[(token_id, logprob), ...] most likely first (dict(lp.top) maps id to logprob); a token's "
                        "text is llm.tokenizer.decode([token_id])")
VLLM_LOGPROB_NAMES = {**dict.fromkeys(("items", "keys", "values", "get"), TOKEN_LOGPROB_FIELDS),
                      "decoded_token": "decode the token: llm.tokenizer.decode([lp.token_id])"}
NOT_VLLM_LOGPROBS = " (it is no vLLM dict of token id to Logprob)"


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log probability under the model, its ``rank`` among the vocabulary (1 for the most likely; as vLLM
    counts it, the number of tokens at least as likely), and the ``top`` most likely token ids at its position with
    theirs (most likely first; as many as the request's ``logprobs`` or ``prompt_logprobs`` asked for)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int

    if not TYPE_CHECKING:  # type checkers keep catching a misspelt attribute and a subscript

        def __getattr__(self, name: str) -> Any:
            """Only for a name it lacks: vLLM's name of what it holds otherwise says what to read."""
            return hinted_attribute(self, name, VLLM_LOGPROB_NAMES, NOT_VLLM_LOGPROBS)

        def __getitem__(self, key: object) -> NoReturn:
            """vLLM's ``logprobs[i][token_id]``: refused, saying what to read (``in`` and iterating too)."""
            raise TypeError(f"'TokenLogprob' object is not subscriptable{NOT_VLLM_LOGPROBS}: {TOKEN_LOGPROB_FIELDS}")

    def to_wire(self) -> list:
        """As JSON: ``[token_id, logprob, [[id, logprob], ...], rank]``."""
        return [self.token_id, self.logprob, [list(pair) for pair in self.top], self.rank]

    @classmethod
    def from_wire(cls, item: list) -> TokenLogprob:
        return cls(item[0], item[1], [tuple(pair) for pair in item[2]], item[3])


@dataclass
class CompletionOutput:
    """One completion of a prompt, as vLLM's ``RequestOutput.outputs[i]`` holds it: sample ``index`` of the prompt's
    ``SamplingParams.n``. ``logprobs`` are Kiln's ``TokenLogprob``s (vLLM's are dicts of token id to Logprob);
    ``cumulative_logprob`` is their sum, None when the request asked for none."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None

    def finished(self) -> bool:
        """Whether the completion has ended (vLLM's ``finished()``)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A finished request: completion text and token ids (a stop token is in `token_ids`, and in `text` only with
    ``include_stop_str_in_output``), with each
    completion token's log probabilities when the request asked for ``logprobs`` and each prompt token's (None for
    the first, which has no context) for ``prompt_logprobs``. ``prompt`` is the prompt's text where the caller gave
    text (for ``LLM.chat``, the rendered conversation), None for token ids. ``outputs`` holds the completions as
    vLLM's does: copies, which the caller may change as vLLM's (``text`` and the other fields stay as the engine
    made them); with ``SamplingParams.n`` > 1, ``LLM.generate`` and ``LLM.chat`` give every sample there, and the
    fields outside it (``text``, ``token_ids``, ``metrics``...) are sample 0's."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    finished: bool = True
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: int | str | None = None  # what stopped it: the stop string or stop token id (tokenizer's EOS: None)
    prompt: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)  # none given: this request's one completion

    def __post_init__(self) -> None:
        if not self.outputs:  # LLM.generate gives a prompt's n samples
            self.outputs = [self.completion(0)]

    @property
    def num_cached_tokens(self) -> int:
        """The prompt tokens the prefix cache served (vLLM's name for ``metrics.num_cached_tokens``)."""
        return self.metrics.num_cached_tokens

    def completion(self, index: int) -> CompletionOutput:
        """This request's completion as sample ``index`` of its prompt (copies of its lists)."""
        cumulative = None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(index, self.text, list(self.token_ids), cumulative, logprobs, self.finish_reason,
                                self.stop_reason)


@dataclass
class StreamDelta:
    """What one step added to a request; the last delta has `finished` set and carries the whole `output`.
    ``logprobs`` has one entry per new token when the request asked for them; the delta of the first completion
    token carries ``prompt_logprobs`` when the request asked for those."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    output: RequestOutput | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def step_delta(seq: Sequence, detokenizer: IncrementalDetokenizer | None, new_token_ids: list[int]) -> StreamDelta:
    """The delta one step emits for ``seq``; once it has finished, with the whole RequestOutput attached."""
    finished = seq.is_finished
    logprobs = seq.logprobs[len(seq.logprobs) - len(new_token_ids):] if seq.logprobs is not None else None
    first = bool(new_token_ids) and seq.num_completion_tokens == len(new_token_ids)
    delta = StreamDelta(seq.request_id, detokenizer.take_delta(finished) if detokenizer else "", new_token_ids,
                        finished, seq.finish_reason, logprobs=logprobs,
                        prompt_logprobs=seq.prompt_logprobs if first else None)
    if finished:
        delta.output = RequestOutput(seq.request_id, seq.prompt_token_ids, detokenizer.text if detokenizer else "",
                                     seq.completion_token_ids, seq.finish_reason, RequestMetrics.from_sequence(seq),
                                     logprobs=seq.logprobs, prompt_logprobs=seq.prompt_logprobs,
                                     stop_reason=seq.stop_reason)
    return delta


class RequestFailedError(KilnError):
    """One request failed inside a step (an engine bug, or an error the TensorRT-LLM executor reported for it);
    the engine serves the others."""


@dataclass(frozen=True)
class RequestFailure:
    """What a step returns for a request that failed on its own: it is finished and its resources are freed."""

    request_id: str
    error: KilnError


def finish_reason(seq: Sequence, token_id: int, detokenizer: IncrementalDetokenizer | None,
                  eos_token_ids: frozenset[int], eos_token_id: int | None) -> str | None:
    """Why ``seq`` finishes with ``token_id`` just appended: "stop" on EOS (unless ``ignore_eos``), a stop token, a
    stop string the detokenizer completes or once its structured output is complete, "length" at ``max_tokens``;
    None while it goes on. A stop token or string is kept as ``seq.stop_reason`` (vLLM's ``stop_reason``), and so is
    an EOS id other than the tokenizer's ``eos_token_id`` (generation_config.json's others, which vLLM adds to
    ``stop_token_ids``). Both engines apply this one rule."""
    params = seq.params
    eos = not params.ignore_eos and token_id in eos_token_ids
    if eos or token_id in params.stop_token_ids:
        if not (eos and token_id == eos_token_id):
            seq.stop_reason = token_id
        if detokenizer is not None:
            detokenizer.end_with_stop_token(token_id)
        return "stop"
    if detokenizer is not None and (stop := detokenizer.add_token(token_id)) is not None:
        seq.stop_reason = stop
        return "stop"
    if seq.matcher is not None and seq.matcher.is_stopped():  # the format is complete: nothing more may follow
        return "stop"
    return "length" if seq.num_completion_tokens >= params.max_tokens else None
