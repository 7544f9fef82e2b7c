"""The loaded engine as the HTTP layer sees it: prompts to token ids, limits, admission, and merged streams."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.runtime.chat_template import ChatTemplate, ChatTemplateError
from kiln.runtime.errors import EngineClosedError, InvalidRequestError, KilnError
from kiln.runtime.json_files import read_json_object
from kiln.runtime.limits import RequestTooLongError
from kiln.runtime.llm import LLM
from kiln.runtime.outputs import RequestOutput, StreamDelta
from kiln.runtime.sampling_defaults import GenerationConfigMode, described, sampling_defaults
from kiln.runtime.sampling_params import SamplingParams, sample_seed
from kiln.runtime.server.errors import OVERLOADED, APIError
from kiln.runtime.server.protocol import ModelCard, ModelPermission, SamplingFields
from kiln.runtime.server.request_id import REQUEST_ID
from kiln.runtime.server.tool_calls import tool_call_format
from kiln.runtime.structured_output import StructuredOutput
from kiln.runtime.tokenizer import GIL_FREE_ENCODE_CHARS

logger = logging.getLogger("kiln.server")
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt's token ids, and whether ``truncate_prompt_tokens`` cut tokens off its front."""

    ids: list[int]
    cut: bool = False


@dataclass
class Job:
    """One sequence to generate: a prompt's token ids and how to sample it."""

    prompt_token_ids: list[int]
    params: SamplingParams


class Admission:
    """A bounded count of sequences in the engine (running plus queued): beyond it, 503 with Retry-After."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.outstanding = 0

    def check_fits(self, num_seqs: int, param: str = "n") -> None:
        """A 400 for a request of more sequences than the server ever holds at once."""
        if num_seqs > self.capacity:
            raise APIError(400, f"this request needs {num_seqs} sequences but the server holds at most "
                                f"{self.capacity}: lower n or send fewer prompts", param=param)

    def reserve(self, num_seqs: int) -> Callable[[], None]:
        """Take `num_seqs` places, or raise a 503; returns the (idempotent) release."""
        self.check_fits(num_seqs)
        if self.outstanding + num_seqs > self.capacity:
            raise APIError(503, f"the server is at capacity ({self.outstanding} of {self.capacity} sequences "
                                f"running or queued): retry after {RETRY_AFTER_S} s",
                           headers={"Retry-After": str(RETRY_AFTER_S)}, kind=OVERLOADED, refusal="capacity")
        self.outstanding += num_seqs
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.outstanding -= num_seqs

        return release


class ServedModel:
    """One loaded engine under one model name (and the ``aliases`` requests may send instead), shared by every HTTP
    request; ``chat_template`` (a template's source) replaces the engine's own (its named ones too: the default and
    ``tool_use``, as vLLM's ``--chat-template`` replaces them), and with a ``reasoning_parser`` chat completions
    carry the model's thinking apart from its answer."""

    def __init__(self, llm: LLM, name: str, engine_dir: Path, max_queue: int,
                 chat_template: str | None = None, generation_config: GenerationConfigMode = "auto",
                 aliases: tuple[str, ...] = (), reasoning_parser: str | None = None) -> None:
        self.llm = llm
        self.name = name
        self.engine_dir = Path(engine_dir)
        self.names = tuple(dict.fromkeys((name, *aliases)))  # responses name the first, as vLLM's do
        self.sampling_defaults = sampling_defaults(engine_dir, generation_config)
        if self.sampling_defaults:
            logger.warning("requests that leave them unset take the sampling defaults of the model's "
                           "generation_config.json, as vLLM's server does: %s (--generation-config vllm: vLLM's own)",
                           described(self.sampling_defaults))
        self.tokenizer = llm.tokenizer
        self.limits = llm.limits
        try:
            self.chat_template = ChatTemplate.from_dir(engine_dir, source=chat_template)
            self.chat_template_problem = None
        except ChatTemplateError as exc:  # completions still work; chat requests say why they cannot
            self.chat_template, self.chat_template_problem = None, str(exc)
        # the format of the template that renders a request with tools (the model's tool_use one, where it has one)
        self.tool_call_format = tool_call_format(self.chat_template.for_tools([]).source) \
            if self.chat_template else None
        self.admission = Admission(self.limits.max_batch_size + max_queue)
        self.logged_ignored_fields: set[str] = set()  # warned of once per server
        self.reasoning_parser = reasoning_parser  # qwen3 or deepseek_r1, checked by ServerSettings

    @functools.cached_property
    def tokenizer_config(self) -> dict[str, Any]:
        """The engine's ``tokenizer_config.json`` ({} without one), read once."""
        path = self.engine_dir / "tokenizer_config.json"
        return read_json_object(path, lambda message: APIError(500, message), "the engine's files are damaged") \
            if path.is_file() else {}

    def card(self, created: int, name: str | None = None) -> ModelCard:
        """The model as ``/v1/models`` lists it (under ``name``, one of its names; default its first)."""
        return ModelCard(id=name or self.name, created=created, root=self.name,
                         permission=[ModelPermission(id=f"modelperm-{self.name}", created=created)],
                         max_model_len=self.limits.max_request_tokens,
                         max_input_len=self.longest_prompt,
                         vocab_size=self.limits.vocab_size)

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a 400 naming ``param`` when there is no tokenizer or the text is not valid
        Unicode."""
        if self.tokenizer is None:
            raise APIError(400, "this engine has no tokenizer: send the prompt as token ids", param=param)
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except InvalidRequestError as exc:
            raise APIError(400, f"'{param}': {exc}", param=param) from None

    @property
    def longest_prompt(self) -> int:
        """The most prompt tokens a request may have: the engine's plan's, and one less than its context."""
        return min(self.limits.max_input_len, self.limits.max_request_tokens - 1)

    def kept_prompt_tokens(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many of a prompt's last tokens vLLM's ``truncate_prompt_tokens`` keeps (None: all; -1: the longest
        prompt the engine takes); more than the model's context is a 400, as in vLLM."""
        if truncate_prompt_tokens == -1:
            return self.longest_prompt
        context = self.limits.max_request_tokens
        if truncate_prompt_tokens is not None and truncate_prompt_tokens > context:
            raise APIError(400, f"truncate_prompt_tokens ({truncate_prompt_tokens}) is more than the model's context "
                                f"of {context} tokens: send at most {self.longest_prompt}, or -1 for that many",
                           param="truncate_prompt_tokens")
        return truncate_prompt_tokens

    def tokenize(self, prompt: str | list[int], param: str, add_special_tokens: bool = True,
                 keep_last: int | None = None) -> TokenizedPrompt:
        """Token ids of a text prompt (or the ids as given), only the ``keep_last`` last ones where set, checked
        against the engine's input limit (an untruncated text too long to fit is refused before it is tokenized)."""
        limit = self.limits.max_input_len
        text = isinstance(prompt, str) and self.tokenizer is not None
        if text and keep_last is None and len(prompt) > limit * self.tokenizer.max_token_bytes:
            raise self._too_long(f"'{param}' has {len(prompt)} characters, more than {limit} tokens can hold: "
                                 f"shorten it", param)
        ids = self.encode(prompt, param, add_special_tokens) if isinstance(prompt, str) else list(prompt)
        cut = keep_last is not None and len(ids) > keep_last
        if cut:
            ids = ids[-keep_last:]
        if not ids:
            raise APIError(400, f"'{param}' is empty after tokenization: send some text", param=param)
        if len(ids) > limit and keep_last is not None:  # a cut that still leaves too many: the cut is at fault
            raise APIError(400, f"truncate_prompt_tokens ({keep_last}) keeps {len(ids)} tokens of '{param}', more "
                                f"than the {limit} this engine takes in a prompt (max_input_len): send at most "
                                f"{limit}, or -1 for that many", param="truncate_prompt_tokens")
        if len(ids) > limit:
            raise self._too_long(f"'{param}' has {len(ids)} tokens: shorten it", param)
        return TokenizedPrompt(ids, cut)

    async def tokenize_many(self, prompts: list[str | list[int]], param: str, add_special_tokens: bool = True,
                            keep_last: int | None = None) -> list[TokenizedPrompt]:
        """``tokenize`` of each prompt; long texts on a worker thread, so the event loop serves other requests
        meanwhile."""
        def run() -> list[TokenizedPrompt]:
            return [self.tokenize(prompt, param, add_special_tokens, keep_last) for prompt in prompts]

        if sum(len(p) for p in prompts if isinstance(p, str)) > GIL_FREE_ENCODE_CHARS:
            return await asyncio.to_thread(run)
        return run()

    def max_tokens(self, prompt_len: int, requested: int | None, default: int | None, param: str) -> int:
        """`requested`, else `default`, else what is left of the context, checked against the engine's limit."""
        context = self.limits.max_request_tokens
        room = context - prompt_len
        if room < 1:
            raise self._too_long(f"the prompt ({prompt_len} tokens) leaves no room to generate: shorten it", param)
        if requested is None:
            return min(default, room) if default is not None else room
        if requested > room:
            raise self._too_long(f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                                 f"{requested} in '{param}'), which leaves room for at most {room}: lower {param} or "
                                 f"shorten the prompt", param)
        return requested

    def check(self, jobs: list[Job], param: str) -> None:
        """Let the engine validate each job (token ids in its vocabulary, KV pool large enough) before any runs."""
        for job in jobs:
            try:
                self.llm.check(job.prompt_token_ids, job.params)
            except EngineClosedError as exc:  # not the request's fault: send it elsewhere
                raise APIError(503, f"the engine is not serving ({exc}): retry against another replica",
                               headers={"Retry-After": str(RETRY_AFTER_S)}, refusal="engine_stopped") from None
            except RequestTooLongError as exc:
                raise self._too_long(str(exc), param) from None
            except KilnError as exc:
                raise APIError(400, str(exc), param=param) from None

    def _too_long(self, problem: str, param: str) -> APIError:
        """A request longer than the engine's context: OpenAI's ``context_length_exceeded``, its message starting
        in the words OpenAI's and vLLM's do (clients match them), then ``problem``."""
        return APIError(400, f"This model's maximum context length is {self.limits.max_request_tokens} tokens, of "
                             f"which at most {self.limits.max_input_len} in the prompt (max_input_len); however, "
                             f"{problem}", param=param, code="context_length_exceeded")

    async def generate_final(self, jobs: list[Job], on_output: Callable[[RequestOutput], None],
                             request_ids: list[str]) -> list[RequestOutput]:
        """Run the jobs together, under ``request_ids``, to their final outputs only (no per-token hop through the
        event loop), passing each to ``on_output`` as it lands; a failure or cancellation aborts every job still
        running."""
        outputs: list[RequestOutput | None] = [None] * len(jobs)
        finals = self.llm.stream_many([job.prompt_token_ids for job in jobs], [job.params for job in jobs],
                                      request_ids=request_ids, final_only=True)
        async with contextlib.aclosing(finals) as batches:
            async for batch in batches:
                for index, delta in batch:
                    outputs[index] = delta.output
                    on_output(delta.output)
        return outputs

    def generate(self, jobs: list[Job], on_finished: Callable[[], None] | None = None,
                 ) -> AsyncIterator[list[tuple[int, StreamDelta]]]:
        """Run the jobs concurrently and yield what arrived since the last yield, as `(job index, delta)` pairs;
        closing this generator (or cancelling its consumer) aborts every job still running, freeing its KV blocks.
        ``on_finished``: called once the engine is done with every job, however far behind the consumer is."""
        return self.llm.stream_many([job.prompt_token_ids for job in jobs], [job.params for job in jobs],
                                    on_finished=on_finished, request_ids=engine_request_ids(len(jobs)))


def engine_request_ids(count: int) -> list[str]:
    """The engine's ids of a request's ``count`` jobs: the request's own id (its X-Request-Id, or the one the server
    gave it), the job's index and a random suffix (clients may send one id twice), so that the engine's log lines
    and errors name what the client knows."""
    return [f"{REQUEST_ID.get()}-{index}-{uuid.uuid4().hex[:8]}" for index in range(count)]


def value_or_default(req: object, name: str, defaults: dict[str, float], fallback: float) -> float:
    """A sampling field as a request (of any API) runs with it: its own value, else the model's default
    (``defaults``, from ``--generation-config``), else ``fallback``."""
    value = getattr(req, name)
    return defaults.get(name, fallback) if value is None else value


def sampling_params(req: SamplingFields, *, max_tokens: int, index: int, logprobs: int | None,
                    prompt_logprobs: int | None, structured_output: StructuredOutput | None,
                    defaults: dict[str, float]) -> SamplingParams:
    """Runtime sampling parameters of choice `index` of a request (a seeded request gives choice i the seed + i, as
    an unsigned 64-bit seed: OpenAI's seed is signed; -1 is no seed, as in vLLM); a field the request leaves unset
    takes the model's default (``defaults``), else SamplingParams'."""
    def given(name: str, fallback: float) -> float:
        return value_or_default(req, name, defaults, fallback)

    temperature = given("temperature", 1.0)
    if req.top_p == 0:
        temperature = 0.0
    seed = sample_seed(None if req.seed == -1 else req.seed, index)
    return SamplingParams(temperature=temperature, top_p=given("top_p", 1.0) or 1.0, top_k=given("top_k", 0),
                          min_p=given("min_p", 0.0), max_tokens=max_tokens, seed=seed, stop=req.stop or [],
                          ignore_eos=req.ignore_eos,
                          presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                          repetition_penalty=given("repetition_penalty", 1.0), logit_bias=req.logit_bias or {},
                          min_tokens=req.min_tokens or 0, stop_token_ids=req.stop_token_ids or [],
                          allowed_token_ids=req.allowed_token_ids, skip_special_tokens=req.skip_special_tokens,
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured_output=structured_output)
