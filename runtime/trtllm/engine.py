"""A TensorRT-LLM 1.2.x engine behind Kiln's engine interface (``runtime.engine.Engine``), run by TensorRT-LLM's C++
executor, so `LLM.load`, `generate`, `stream`, `abort` and the server work unchanged. The executor does the in-flight
batching, paged KV and block reuse; Kiln keeps tokenization, stop strings and metrics. `tensorrt_llm` is imported
only when an engine is loaded.

An engine directory holds what trtllm-build wrote (`config.json`, `rank<N>.engine`), the tokenizer files and
`kiln_trtllm.json` (``engine_info.TrtllmEngineInfo``): the plan, the EOS ids and the fingerprint of the build machine.
"""

from __future__ import annotations

import secrets
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.limits import EngineLimits
from kiln.runtime.options import DEFAULT_SCHEDULER_POLICY, RuntimeOptions
from kiln.runtime.outputs import (
    RequestFailedError,
    RequestFailure,
    StreamDelta,
    finish_reason,
    step_delta,
)
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence
from kiln.runtime.stats import EngineStats
from kiln.runtime.tokenizer import IncrementalDetokenizer, Tokenizer, encode_prompt, request_detokenizer
from kiln.runtime.tokenizer_files import tokenizer_eos_id
from kiln.runtime.trtllm.engine_info import TrtllmEngineInfo, ranks_not_loaded
from kiln.runtime.trtllm.iteration_steps import IterationSteps
from kiln.runtime.trtllm.toolchain import (
    TrtllmUnavailableError,
    check_trtllm_fingerprint,
    import_executor_module,
    trtllm_machine_fingerprint,
)

# RuntimeOptions that choose how Kiln's native engine runs; TensorRT-LLM's engine runs its own kernels and graphs
NATIVE_ONLY_OPTIONS = ("kernels", "cuda_graphs", "cuda_graph_capture", "overlap_steps", "pdl", "attention_fp8_pv",
                       "linear_max_m", "gpu_memory_utilization")

# iterations whose statistics the executor keeps until they are drained (its default, passed so that the steps
# cannot be switched off unseen: 0 keeps none); the engine drains them every step
ITERATION_STATS_KEPT = 1000
FINISH_REASONS = {"END_ID": "stop", "STOP_WORDS": "stop", "LENGTH": "length", "CANCELLED": "abort",
                   "TIMED_OUT": "abort"}
# the bits of the random seed an unseeded drawn request gets: the executor seeds every request without one 0, so all
# would draw the same tokens
SEED_BITS = 63
# why presence and frequency penalties are refused: TensorRT-LLM 1.2's penalty kernel (batchApplyPenalty) counts the
# prompt's tokens too and subtracts after dividing by the temperature
PENALTY_REFUSAL = ("the TensorRT-LLM 1.2 executor counts the prompt's tokens into these penalties and applies them "
                   "after the temperature, where Kiln follows OpenAI (completion tokens only, before the temperature); "
                   "use repetition_penalty (it counts the prompt on every backend, as in vLLM, and scales a logit, "
                   "which comes out the same before or after the temperature) or an engine of the native backend")


class TrtllmRequestError(InvalidRequestError):
    """A request this engine cannot take (bad token ids, too long, text without a tokenizer)."""


class _Request:
    """A request's Kiln-side state: the sequence, its detokenizer, and the executor's id for it."""

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer | None) -> None:
        self.seq = seq
        self.detokenizer = detokenizer
        self.executor_id: int | None = None


class TrtllmEngine:
    """TensorRT-LLM's executor (in-flight batching, paged KV, block reuse, chunked context) as a Kiln engine."""

    def __init__(self, engine_dir: Path, options: RuntimeOptions, *, free_gpu_memory_fraction: float = 0.9,
                 poll_ms: int = 10) -> None:
        engine_dir = Path(engine_dir)
        if options.device is not None and not options.device.startswith("cuda"):
            raise TrtllmUnavailableError(f"device {options.device!r}: TensorRT-LLM engines run on CUDA GPUs only")
        if native := options.changed(*NATIVE_ONLY_OPTIONS):
            raise TrtllmUnavailableError(f"{', '.join(native)}: these options choose how Kiln's native engine runs, "
                                         f"and {engine_dir} is a TensorRT-LLM engine, which runs its own kernels and "
                                         f"graphs; leave them at their defaults")
        self.info = TrtllmEngineInfo.load(engine_dir)
        self.trtllm = import_executor_module()
        check_trtllm_fingerprint(self.info.fingerprint, trtllm_machine_fingerprint())
        if why := ranks_not_loaded(self.info.tp_size, self.info.pp_size):
            raise TrtllmUnavailableError(f"{engine_dir}: {why}, or build with tp_size 1 and pp_size 1")
        self.tokenizer = Tokenizer.from_dir(engine_dir)
        self.limits = EngineLimits.from_plan(self.info.plan, vocab_size=self.info.vocab_size)  # no pool: the
        # executor sizes its KV pool itself
        self.eos_token_ids = frozenset(self.info.eos_token_ids)
        self.eos_token_id = tokenizer_eos_id(engine_dir, self.tokenizer)  # its EOS: stop_reason None
        self.stats = EngineStats()
        self._poll = timedelta(milliseconds=poll_ms)
        self._requests: dict[str, _Request] = {}
        self._by_executor_id: dict[int, str] = {}
        self._errors: list[str] = []
        self._prefix_caching = options.prefix_caching
        self._iteration: Any = None  # the executor's IterationStats of its latest iteration, None before the first
        self._steps = IterationSteps()  # its iterations, recorded as steps as they are drained
        self._iteration_lock = threading.Lock()  # held while draining the executor's statistics, and to shut it down
        self._shut_down = False
        policy = options.scheduler_policy or DEFAULT_SCHEDULER_POLICY["trtllm"]
        self.executor = self.trtllm.Executor(engine_dir, self.trtllm.ModelType.DECODER_ONLY,
                                             self._executor_config(options.num_kv_blocks, free_gpu_memory_fraction,
                                                                   policy, options.prefix_caching))

    def _executor_config(self, num_kv_blocks: int | None, free_gpu_memory_fraction: float,
                         scheduler_policy: str, prefix_caching: bool) -> Any:
        trtllm = self.trtllm
        max_tokens = None if num_kv_blocks is None else num_kv_blocks * self.info.plan.tokens_per_block
        kv_cache = trtllm.KvCacheConfig(enable_block_reuse=prefix_caching, max_tokens=max_tokens,
                                        free_gpu_memory_fraction=free_gpu_memory_fraction)
        policy = getattr(trtllm.CapacitySchedulerPolicy, scheduler_policy.upper())  # the same two names
        scheduler = trtllm.SchedulerConfig(capacity_scheduler_policy=policy)
        return trtllm.ExecutorConfig(max_beam_width=1, scheduler_config=scheduler, kv_cache_config=kv_cache,
                                     enable_chunked_context=True, batching_type=trtllm.BatchingType.INFLIGHT,
                                     iter_stats_max_iterations=ITERATION_STATS_KEPT)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenize and validate a request without touching the executor (safe from any thread)."""
        unsupported = [name for name, asked in (("logprobs", params.logprobs is not None),
                                                ("prompt_logprobs", params.prompt_logprobs is not None),
                                                ("logit_bias", bool(params.logit_bias)),
                                                ("allowed_token_ids", params.allowed_token_ids is not None),
                                                ("structured_output", params.structured_output is not None)) if asked]
        if unsupported:
            raise TrtllmRequestError(f"the TensorRT-LLM backend does not serve {', '.join(unsupported)} yet: use an "
                                     f"engine of the native backend for these")
        if penalties := [name for name in ("presence_penalty", "frequency_penalty") if getattr(params, name)]:
            raise TrtllmRequestError(f"{' and '.join(penalties)}: {PENALTY_REFUSAL}")
        end_id = self._end_id(params)
        if params.min_tokens and (early := [t for t in self._stop_ids(params) if t != end_id]):
            held = "no token (ignore_eos sends no end id)" if end_id is None else f"only the end id ({end_id})"
            raise TrtllmRequestError(
                f"min_tokens {params.min_tokens} with stop token ids {early} (stop_token_ids and the engine's other "
                f"EOS ids): the TensorRT-LLM 1.2 executor holds back {held} until min_tokens, so these could still "
                f"end the request early; leave min_tokens at 0, or use an engine of the native backend, which holds "
                f"them all back")
        token_ids = encode_prompt(prompt, self.tokenizer, self.limits.vocab_size, bool(params.stop), TrtllmRequestError)
        return Sequence(request_id, token_ids, self.limits.taken(len(token_ids), params))

    def add_request(self, seq: Sequence) -> None:
        """Hand a request to the executor."""
        if seq.request_id in self._requests:
            raise TrtllmRequestError(f"request id {seq.request_id!r} is already in use: pick a unique id")
        detokenizer = request_detokenizer(self.tokenizer, seq.prompt_token_ids, seq.params)
        state = _Request(seq, detokenizer)
        try:
            state.executor_id = self.executor.enqueue_request(self._executor_request(seq))
        except RuntimeError as e:
            raise TrtllmRequestError(f"TensorRT-LLM refused request {seq.request_id}: {e}") from None
        self._requests[seq.request_id] = state
        self._by_executor_id[state.executor_id] = seq.request_id

    def _executor_request(self, seq: Sequence) -> Any:
        trtllm, params = self.trtllm, seq.params
        return trtllm.Request(input_token_ids=seq.prompt_token_ids, max_tokens=params.max_tokens, streaming=True,
                              sampling_config=self._sampling_config(params),
                              output_config=trtllm.OutputConfig(exclude_input_from_output=True),
                              end_id=self._end_id(params), stop_words=[[t] for t in self._stop_ids(params)] or None)

    def _end_id(self, params: SamplingParams) -> int | None:
        """The executor's end id: the tokenizer's EOS, so that the engine's other EOS ids end as stop words, which
        keep their token in the output, for their stop_reason; None with ``ignore_eos``."""
        eos = self.info.eos_token_ids
        return None if params.ignore_eos or not eos else self.eos_token_id if self.eos_token_id in eos else eos[0]

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        """The token ids sent as stop words: ``stop_token_ids`` and, unless ``ignore_eos``, every EOS id."""
        return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)))

    def _sampling_config(self, params: SamplingParams) -> Any:
        """The executor's sampling config: greedy as top-k 1; the repetition penalty and min_tokens as TensorRT-LLM's
        own (``make_request`` refuses the presence and frequency penalties, and a min_tokens it would not honour). A
        drawn request sends top-k and top-p always (0 and 1.0 when off): the executor reads both unset as 0, which
        its sampling kernel turns into top-k 1, greedy whatever the temperature. An unseeded drawn request gets a
        random seed of its own: the executor seeds each request without one 0, so all would draw alike."""
        seed = params.seed if params.seed is not None or params.greedy else secrets.randbits(SEED_BITS)
        return self.trtllm.SamplingConfig(
            beam_width=1, top_k=1 if params.greedy else max(params.top_k, 0),
            top_p=None if params.greedy else params.top_p,
            min_p=None if params.greedy or not params.min_p else params.min_p,
            temperature=None if params.greedy else params.temperature, seed=seed,
            min_tokens=params.min_tokens or None,
            repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1 else None)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def interrupt(self) -> bool:
        """The executor's steps cannot be stopped from another thread."""
        return False

    def failure(self) -> None:
        """The executor reports its errors through the responses a step reads."""
        return None

    def warm_up_step(self) -> bool:
        """Nothing is deferred: the executor is ready once loaded."""
        return False

    def step(self) -> list[StreamDelta | RequestFailure]:
        """Collect what the executor produced since the last call (waits up to `poll_ms` for it), and record the
        iterations it ran as steps (draining their statistics is a mutex and a move of a short queue)."""
        deltas = []
        for response in self.executor.await_responses(timeout=self._poll):
            request_id = self._by_executor_id.get(response.request_id)
            if request_id is not None:
                deltas.append(self._on_response(self._requests[request_id], response))
        self._drain_iterations()
        return deltas

    def _on_response(self, state: _Request, response: Any) -> StreamDelta | RequestFailure:
        seq = state.seq
        if response.has_error():
            self._errors.append(f"{seq.request_id}: {response.error_msg}")
            self._finish(state, "error", [], executor_done=True)
            return RequestFailure(seq.request_id, RequestFailedError(
                f"request {seq.request_id} failed in the TensorRT-LLM executor: {response.error_msg}"))
        result = response.result
        new_tokens = []
        for token_id in (result.output_token_ids or [[]])[0]:
            new_tokens.append(token_id)
            seq.append_token(token_id)
            reason = finish_reason(seq, token_id, state.detokenizer, self.eos_token_ids, self.eos_token_id)
            if reason is not None:
                return self._finish(state, reason, new_tokens, executor_done=result.is_final)
        if result.is_final:
            names = [getattr(r, "name", str(r)) for r in result.finish_reasons]
            reason = FINISH_REASONS.get(names[0] if names else "", "stop")
            return self._finish(state, reason, new_tokens, executor_done=True)
        return self._emit(state, new_tokens)

    def abort_request(self, request_id: str) -> StreamDelta | None:
        """Cancel a request in the executor and finish it with reason "abort"; None if it is not here."""
        state = self._requests.get(request_id)
        return None if state is None else self._finish(state, "abort", [])

    def _finish(self, state: _Request, reason: str, new_tokens: list[int], executor_done: bool = False) -> StreamDelta:
        """Finish on Kiln's side; the executor is told to stop when it has not finished the request itself."""
        self._by_executor_id.pop(state.executor_id, None)
        if not executor_done:
            self.executor.cancel_request(state.executor_id)
        state.seq.finish(reason)
        return self._emit(state, new_tokens)

    def _emit(self, state: _Request, new_tokens: list[int]) -> StreamDelta:
        """The request's delta of ``new_tokens``, counted as vLLM counts an iteration's tokens: each token, and the
        whole prompt with a request's first tokens."""
        seq = state.seq
        first = bool(new_tokens) and seq.num_completion_tokens == len(new_tokens)
        self.stats.record_tokens(seq.num_prompt_tokens if first else 0, len(new_tokens))
        if seq.is_finished:
            del self._requests[seq.request_id]
            self.stats.record_finished(seq)
        return step_delta(seq, state.detokenizer, new_tokens)

    def stats_snapshot(self) -> dict:
        """Request counters and latency summaries, plus the executor's queue, KV pool and block reuse as of its latest
        iteration (those keys are absent until it has run one). Safe from any thread."""
        iteration = self._drain_iterations()  # first, so the steps it records are in this snapshot
        snapshot = {**self.stats.snapshot(), "backend": "trtllm", "num_running": len(self._requests),
                    "recent_errors": self._errors[-5:]}
        if iteration is not None:
            snapshot.update(iteration_snapshot(iteration, self.info.plan.kv_cache_dtype, self._prefix_caching))
        return snapshot

    def _drain_iterations(self) -> Any:
        """Record the executor's iterations since the last drain as steps (``IterationSteps``); the statistics of its
        latest iteration. Reading them empties the executor's queue of them (under its own lock, so from any thread:
        the engine's step and a stats read), so the latest is kept for the next read. The executor posts an idle
        iteration once its last request has gone, so an idle engine reads idle."""
        with self._iteration_lock:
            if not self._shut_down:
                for iteration in self.executor.get_latest_iteration_stats():
                    if (step := self._steps.add(iteration)) is not None:
                        self.stats.record_step(step)
                    self._iteration = iteration
            return self._iteration

    def close(self) -> None:
        """Shut the executor down (its worker threads and GPU memory)."""
        with self._iteration_lock:  # the executor refuses every call once shut down
            self._shut_down = True
        self.executor.shutdown()


def iteration_snapshot(iteration: Any, kv_cache_dtype: str, prefix_caching: bool) -> dict:
    """An executor ``IterationStats`` under the keys of the native engine's snapshot. Block reuse is counted in
    blocks (``reused_blocks``, ``missed_blocks``), so the prefix cache's tokens are left out rather than guessed."""
    snapshot = {"num_running": iteration.num_active_requests, "num_waiting": iteration.num_queued_requests}
    kv = iteration.kv_cache_stats  # None for an engine without a KV cache manager
    if kv is not None:
        snapshot["kv_cache"] = {"num_blocks": kv.max_num_blocks, "block_size": kv.tokens_per_block,
                                "used_blocks": kv.used_num_blocks, "free_blocks": kv.free_num_blocks,
                                "dtype": kv_cache_dtype, "prefix_caching": prefix_caching}
        looked_up = kv.reused_blocks + kv.missed_blocks
        snapshot["prefix_cache"] = {"hit_blocks": kv.reused_blocks, "missed_blocks": kv.missed_blocks,
                                    "hit_rate": kv.reused_blocks / looked_up if looked_up else 0.0}
    return snapshot


