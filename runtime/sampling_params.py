"""Per-request sampling parameters."""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import math
import numbers
import operator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from kiln.runtime.json_files import is_number
from kiln.runtime.structured_output import StructuredOutput

# Temperatures below this sample greedily (as in vLLM): dividing logits by a tinier one overflows them to inf.
GREEDY_TEMPERATURE = 1e-5
# Seeds are unsigned 64-bit, what both torch.Generator.manual_seed and TensorRT-LLM's SamplingConfig take.
MAX_SEED = 2**64 - 1
# The most alternatives a token's (or a prompt token's) log probabilities list, as in OpenAI's API and vLLM.
MAX_LOGPROBS = 20
# OpenAI's ranges: presence and frequency penalties in [-2, 2], a logit bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# A repetition penalty outside this range overflows the logits it divides (and no model needs one).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# what changes the logits instead of vLLM's logits processors and extra_args
LOGIT_CONTROLS = "it changes logits with logit_bias, allowed_token_ids, min_tokens, the penalties and structured_output"
# Settings of other engines (vLLM's, SGLang's, TensorRT-LLM's) and what to do instead, for the error they get.
OTHER_NAMES = {"max_new_tokens": "set max_tokens", "min_new_tokens": "set min_tokens", "end_id": "set stop_token_ids",
               "stop_words": "set stop", "random_seed": "set seed", "sampling_seed": "set seed",
               "return_log_probs": "set logprobs", "guided_decoding": "set structured_output",
               "bad_words": "set logit_bias to -100 for each of their token ids",
               "use_beam_search": "Kiln samples or decodes greedily, without beams",
               "best_of": "LLM.generate returns all n samples: ask n=k with logprobs and keep the best by "
                          "cumulative_logprob",
               "spaces_between_special_tokens": "Kiln decodes special tokens as the tokenizer does (vLLM's default)",
               "regex": "set structured_output=StructuredOutput(regex=...)",
               "json_schema": "set structured_output=StructuredOutput(json=...)",
               "structured_outputs": "set structured_output, Kiln's name (a StructuredOutput, or a dict of its "
                                     "fields json, json_object, regex, grammar, choice)",
               "truncate_prompt_tokens": "cut the prompt's token ids yourself and pass them as the prompt: "
                                         "{'prompt_token_ids': llm.tokenizer.encode(text)[-k:]}",
               "logits_processors": f"Kiln runs no Python logits processors; {LOGIT_CONTROLS}",
               "extra_args": f"Kiln reads no extra_args; {LOGIT_CONTROLS}",
               "output_kind": "LLM.generate returns each request's final output (vLLM's LLM.generate sets "
                              "FINAL_ONLY whatever it is given); for what each step adds, iterate LLM.stream (its "
                              "deltas are DELTA's; join them for CUMULATIVE's)"}
# vLLM's settings that Kiln lacks, at the values that change nothing (their defaults): taken and dropped, so that
# code spelling out vLLM's defaults runs; any other value is refused (OTHER_NAMES)
VLLM_NO_OP_VALUES: dict[str, tuple] = {
    "spaces_between_special_tokens": (True,), "best_of": (None,),
    "use_beam_search": (False,), "bad_words": (None, []), "guided_decoding": (None,), "structured_outputs": (None,),
    "logits_processors": (None, []), "truncate_prompt_tokens": (None,), "extra_args": (None, {}),
    "flat_logprobs": (False,), "output_kind": ()}
# vLLM's settings also taken at a value that VLLM_NO_OP_VALUES cannot hold, in words (``_changes_nothing`` decides)
NO_OP_WORDS = {"best_of": "n", "output_kind": "RequestOutputKind.FINAL_ONLY"}
# what n > 1 asks of an engine, whose requests make one completion each
ONE_COMPLETION = ("a request makes one completion: LLM.generate and LLM.chat make n of each prompt (vLLM's n), or "
                  "pass the prompt n times, with seed + i for sample i")
NUMBER_FIELDS = ("n", "temperature", "top_k", "top_p", "min_p", "max_tokens", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "prompt_logprobs")


@dataclass(kw_only=True)  # by name only: vLLM's first positional setting is n, Kiln's order differs
class SamplingParams:
    """How to pick tokens and when to stop, in vLLM's vocabulary.

    `temperature=0` (or anything below 1e-5) is greedy. `top_k=0` (or -1) and `top_p=1` disable those filters.
    `seed`, an int in [0, 2**64 - 1] (-1: none, as in vLLM), makes the draw this request's own whatever else shares
    its batch.
    Generation stops at `max_tokens` (finish_reason "length"; None: at the end of the context), at a token in
    `stop_token_ids` or the engine's EOS unless `ignore_eos`, or at a string in `stop`, which is cut from the text
    (finish_reason "stop"). `include_stop_str_in_output=True` keeps the text of what stopped it at the end of the
    text, as vLLM does: the stop string (and nothing after it), or the stop token's text (none for a special token
    unless ``skip_special_tokens=False``).
    `detokenize=False` returns token ids only (the text stays empty, as TensorRT-LLM's executor and transformers'
    `generate` return them), which saves decoding every token; stop strings need the text. `skip_special_tokens=False`
    keeps the special tokens the model generates in the text (as vLLM: not the EOS or stop token that ends it).

    Logit controls, applied before temperature, top-k and top-p: `presence_penalty` and `frequency_penalty` (OpenAI's
    semantics, in [-2, 2]: subtracted once per token id present in the completion, and once per occurrence),
    `repetition_penalty` (transformers' semantics, in [0.01, 100]: a logit of a token in the prompt or the completion is
    divided by it when positive, multiplied when negative), `logit_bias` (token id, or its decimal string as in a
    JSON object, -> a bias in [-100, 100] added to its logit), `allowed_token_ids` (sample, greedy too, only among
    these token ids) and `min_tokens` (no EOS, stop token or stop string before that many completion tokens).
    `logprobs=k` returns each completion token's log probability and the `k` most likely alternatives (0 <= k <=
    20); `prompt_logprobs=k` the same for every prompt token after the first. They are the model's own
    distribution (log-softmax of its logits, before the controls and the temperature), as vLLM returns by default.
    `structured_output` holds the completion to a format (``StructuredOutput``: a JSON schema, any JSON object, a
    regex, a grammar or a choice); the request finishes with "stop" once the format is complete.
    `n` samples of each prompt in `LLM.generate` and `LLM.chat`, as in vLLM (`RequestOutput.outputs`): each runs as a
    request of its own, sample i seeded `seed + i` when `seed` is set; one request of the engine's makes one.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to the context (what the engine's limits leave after the prompt)
    seed: int | None = None
    stop: list[str] | str | None = field(default_factory=list)  # one string is one stop string; None: none
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | dict | None = None  # a dict of its fields too
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        for name, kind, accepted in (("stop", list, list | tuple), ("stop_token_ids", list, list | tuple),
                                     ("logit_bias", dict, dict)):
            value = getattr(self, name)  # None is the empty one, as in the OpenAI API
            if value is not None and not isinstance(value, accepted):
                raise ValueError(f"SamplingParams.{name} must be a {kind.__name__} or None, got {value!r}")
            setattr(self, name, kind(value or ()))
        for name in NUMBER_FIELDS:
            setattr(self, name, plain_number(getattr(self, name)))
        self.stop_token_ids = _plain_ids(self.stop_token_ids)
        self.logit_bias = {_token_key(t): plain_number(bias) for t, bias in self.logit_bias.items()}
        if isinstance(self.allowed_token_ids, list | tuple):
            self.allowed_token_ids = _plain_ids(self.allowed_token_ids)
        self._validate()
        self._validate_controls()
        if self.structured_output is not None:
            self.structured_output = StructuredOutput.from_dict(self.structured_output)
            _ = self.structured_output.llguidance_grammar  # a format that cannot compile is refused here
            for name in ("ignore_eos", "min_tokens"):
                if getattr(self, name):
                    raise ValueError(f"SamplingParams.{name} cannot be combined with a structured output format: the "
                                     f"completion ends as soon as the format is complete")

    if not TYPE_CHECKING:  # type checkers keep the dataclass's own signature and catch a misspelt attribute

        def __new__(cls, *args: object, **kwargs: object) -> SamplingParams:
            """Refuse a setting the class lacks by name, saying what to give instead (another engine's name)."""
            drops_no_ops = getattr(cls.__init__, "drops_vllm_no_ops", False)  # a dataclass subclass's own takes none
            if args and drops_no_ops:
                raise TypeError(f"{cls.__name__}() takes its settings by name only, got {', '.join(map(repr, args))} "
                                f"by position: name each (vLLM's first positional setting is n: "
                                f"{cls.__name__}(n={args[0]!r}))")
            if unknown := [name for name, value in kwargs.items()
                           if name not in _settings(cls)
                           and not (drops_no_ops and _changes_nothing(name, value, kwargs.get("n", 1)))]:
                name = unknown[0]
                if drops_no_ops and name in VLLM_NO_OP_VALUES:
                    instead = f": {OTHER_NAMES[name]}" if name in OTHER_NAMES else ""  # no other setting's name
                    raise ValueError(f"{cls.__name__} takes vLLM's {name} only at a value that changes nothing "
                                     f"({_no_op_values(name)}), got {kwargs[name]!r}{instead}")
                raise TypeError(f"{cls.__name__} has no setting {name!r}{_instead(name, cls)}")
            return super().__new__(cls)

        def __setattr__(self, name: str, value: object) -> None:
            """Set a setting; a name the class has no setting of is refused (it would be dropped unseen), unless it is
            vLLM's at a value that changes nothing (VLLM_NO_OP_VALUES), which is dropped."""
            if name not in _settings(type(self)):
                if _changes_nothing(name, value, self.n):
                    return
                raise AttributeError(f"{type(self).__name__} has no setting {name!r}{_instead(name, type(self))}")
            object.__setattr__(self, name, value)

    def _validate(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0 is greedy), "
                             f"got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an int >= 1, or 0/-1 to disable it, got {self.top_k!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, or None for up to the context, got "
                             f"{self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**64 - 1], got {self.seed}: reduce it modulo 2**64")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams.stop needs detokenize=True: stop strings are found in the text")
        if not _are_token_ids(self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be True or False, got {getattr(self, name)!r}")

    def _validate_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"SamplingParams.{name} must be a number in [-2, 2] (0 is off), got {value!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not is_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise ValueError(f"SamplingParams.repetition_penalty must be a number in [{low}, {high}] (1 is off), "
                             f"got {self.repetition_penalty!r}")
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"SamplingParams.logit_bias keys must be token ids >= 0, got {token_id!r}")
            if not is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"SamplingParams.logit_bias[{token_id}] must be a number in [-100, 100], got {bias!r}")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not allowed or not _are_token_ids(allowed)):
            raise ValueError(f"SamplingParams.allowed_token_ids must be None or a non-empty list of token ids >= 0, "
                             f"got {allowed!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise ValueError(f"SamplingParams.min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"SamplingParams.{name} must be None or an int in [0, {MAX_LOGPROBS}] (the number of "
                                 f"alternatives per token), got {value!r}")

    @property
    def penalizes_repeats(self) -> bool:
        """Whether the logits depend on the tokens so far (a presence, frequency or repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def controls_logits(self) -> bool:
        """Whether anything changes the model's logits before sampling (penalties, a bias, allowed token ids, a minimum
        length)."""
        return (self.penalizes_repeats or bool(self.logit_bias) or self.allowed_token_ids is not None
                or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (a temperature below GREEDY_TEMPERATURE)."""
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self) -> SamplingParams:
        """A deep copy, whose changes do not reach this one (vLLM's ``clone``)."""
        return copy.deepcopy(self)


if not TYPE_CHECKING:  # the dataclass's signature stays what type checkers see
    _init_of_fields = SamplingParams.__init__

    @functools.wraps(_init_of_fields)
    def _init_dropping_no_ops(self: SamplingParams, *args: object, **kwargs: object) -> None:
        _init_of_fields(self, *args, **{name: value for name, value in kwargs.items()
                                       if not (name in VLLM_NO_OP_VALUES
                                               and _changes_nothing(name, value, kwargs.get("n", 1)))})

    _init_dropping_no_ops.drops_vllm_no_ops = True
    SamplingParams.__init__ = _init_dropping_no_ops


def _changes_nothing(name: str, value: object, n: object) -> bool:
    """Whether ``value`` of vLLM's setting ``name`` is one that Kiln's behaviour already is (VLLM_NO_OP_VALUES,
    vLLM's ``best_of`` equal to the request's ``n``: every sample returned, and its ``output_kind`` FINAL_ONLY)."""
    if name == "best_of" and type(value) is int and value == n:
        return True
    if name == "output_kind":  # vLLM's enum, not imported: what LLM.generate returns (vLLM's sets it there too)
        return type(value).__name__ == "RequestOutputKind" and getattr(value, "name", None) == "FINAL_ONLY"
    return any(same_value(value, same) for same in VLLM_NO_OP_VALUES.get(name, ()))


def same_value(value: object, same: object) -> bool:
    """Whether a setting's ``value`` is ``same`` (True is no 1, a float no int: a value of another type is another
    setting)."""
    return value is same or (type(value) is type(same) and value == same)


def _token_key(key: object) -> object:
    """A logit_bias key as a token id: a string of decimal digits (a JSON object's key, as OpenAI's API and vLLM take
    it) as its int, a number of any library as a Python int; anything else as it is, for the check to name."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return plain_number(key)


def _no_op_values(name: str) -> str:
    """The values of vLLM's setting ``name`` that Kiln takes, as words."""
    words = [repr(value) for value in VLLM_NO_OP_VALUES[name]]
    if name in NO_OP_WORDS:
        words.append(NO_OP_WORDS[name])
    return " or ".join(words)


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of a request seeded ``seed`` (vLLM's ``n``, an OpenAI request's choices):
    ``seed + index`` as an unsigned 64-bit seed (a negative OpenAI seed too); None for an unseeded request."""
    return None if seed is None else (seed + index) % (MAX_SEED + 1)


@functools.cache
def _settings(cls: type[SamplingParams]) -> frozenset[str]:
    """The setting names of ``cls`` (a subclass's own fields included)."""
    return frozenset(setting.name for setting in fields(cls))


def _instead(name: str, cls: type[SamplingParams]) -> str:
    """What to set instead of ``name``: the setting another engine's name stands for, or the closest spelling."""
    if name in OTHER_NAMES:
        return f": {OTHER_NAMES[name]}"
    settings = _settings(cls)
    close = difflib.get_close_matches(name, settings, n=1)
    return f": did you mean {close[0]}?" if close else f"; its settings are {', '.join(sorted(settings))}"


def plain_number(value: object) -> object:
    """A number of any library (NumPy's, a one-element torch tensor's) as a Python int or float; anything else (a
    bool of any library too) as it is."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return value
    with contextlib.suppress(TypeError):  # an integer of any library
        return operator.index(value)
    if isinstance(value, numbers.Real):
        return value if isinstance(value, float) else float(value)
    if getattr(value, "ndim", None) == 0 and "float" in str(getattr(value, "dtype", "")):
        return float(value)  # a 0-d floating torch tensor, which is no numbers.Real
    return value


def _plain_ids(values: list | tuple) -> list:
    """Token ids as a list of Python ints (NumPy's and torch's converted); a list of Python ints, the usual case,
    is copied without a call per id (a server makes one SamplingParams a prompt, each of up to a vocabulary's ids)."""
    if all(type(t) is int for t in values):
        return list(values)
    return [plain_number(t) for t in values]


def _are_token_ids(values: list) -> bool:
    """Whether every value is an int (not a bool) >= 0."""
    if all(type(t) is int for t in values):  # the usual case, without a call per id
        return not values or min(values) >= 0
    return all(_is_int(t) and t >= 0 for t in values)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
