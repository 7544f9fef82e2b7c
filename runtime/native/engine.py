"""The step loop: schedule, run the model, postprocess sampled tokens, emit what each request gained."""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

import torch

from kiln.runtime.errors import InvalidRequestError, KilnError, SamplingError, TensorParallelError
from kiln.runtime.limits import EngineLimits
from kiln.runtime.native.block_manager import BlockManager
from kiln.runtime.native.engine_format import EngineConfig
from kiln.runtime.native.fingerprint import check_fingerprint, machine_fingerprint, resolve_device
from kiln.runtime.native.grammar import Grammars, advance_matcher
from kiln.runtime.native.model_runner import LaunchedStep, ModelRunner
from kiln.runtime.native.parallel.launch import TensorParallelRanks
from kiln.runtime.native.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.options import DEFAULT_SCHEDULER_POLICY, RuntimeOptions, RuntimeOptionsError
from kiln.runtime.outputs import (
    RequestFailedError,
    RequestFailure,
    StreamDelta,
    TokenLogprob,
    finish_reason,
    step_delta,
)
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence
from kiln.runtime.stats import EngineStats, PhaseTimes, StepStats
from kiln.runtime.structured_output import StructuredOutputError
from kiln.runtime.tokenizer import IncrementalDetokenizer, Tokenizer, encode_prompt, request_detokenizer
from kiln.runtime.tokenizer_files import tokenizer_eos_id

logger = logging.getLogger("kiln.runtime")


class NativeEngine:
    """Single-threaded core: requests in, one step at a time, deltas out (``runtime.engine.Engine``). `LLM` drives it
    from a thread."""

    def __init__(self, engine_dir: Path, options: RuntimeOptions) -> None:
        engine_dir = Path(engine_dir)
        self.config = EngineConfig.load(engine_dir)
        self.device = resolve_device(options.device, self.config.fingerprint)
        check_fingerprint(self.config.fingerprint, machine_fingerprint(str(self.device)))
        self.tokenizer = Tokenizer.from_dir(engine_dir)
        architecture = self.config.architecture
        self.grammars = Grammars(self.tokenizer, architecture.vocab_size, architecture.eos_token_ids)
        if self.config.tp_size > 1 and options.cuda_graph_capture == "deferred":
            raise RuntimeOptionsError("cuda_graph_capture 'deferred' cannot run a tensor-parallel engine: its ranks "
                                      "capture their CUDA graphs together, at load; leave it unset or pass 'at_load'")
        options.check_applies(self.device.type, self.config.tp_size)
        # a tensor-parallel engine: this process is rank 0, the other ranks are worker processes it starts
        self.rank_load_times = PhaseTimes()  # a tensor-parallel load's phases outside this rank's model runner
        self.ranks: TensorParallelRanks | None = None
        if self.config.tp_size > 1:
            with self.rank_load_times.phase("ranks_joined"):  # the workers started and met
                self.ranks = TensorParallelRanks(engine_dir, options, self.config.tp_size, self.device)
        try:
            self.model_runner = ModelRunner(engine_dir, self.config, self.device, options, self.grammars,
                                            tp=self.ranks.group if self.ranks else None,
                                            channel=self.ranks.channel if self.ranks else None)
            if self.ranks is not None:
                with self.rank_load_times.phase("other_ranks_loaded"):  # after this rank's own load
                    self.ranks.wait_for_workers_loaded()
        except BaseException as e:
            if self.ranks is None:
                raise
            failure = self.ranks.failure_after_error() if isinstance(e, Exception) else None
            self.ranks.stop_workers()
            if failure is None:
                raise
            raise TensorParallelError(f"{failure} while the engine was loading (its error is above)") from e
        plan = self.config.plan
        self.block_manager = BlockManager(self.model_runner.num_kv_blocks, plan.tokens_per_block,
                                          options.prefix_caching)
        self.limits = EngineLimits.from_plan(plan, vocab_size=self.config.architecture.vocab_size,
                                             kv_pool_tokens=self.block_manager.num_blocks * plan.tokens_per_block)
        self.scheduler = Scheduler(self.limits, self.block_manager,
                                   options.scheduler_policy or DEFAULT_SCHEDULER_POLICY["native"])
        self.eos_token_ids = frozenset(self.config.architecture.eos_token_ids)
        self.eos_token_id = tokenizer_eos_id(engine_dir, self.tokenizer)  # its EOS: stop_reason None
        self.stats = EngineStats()
        self.num_cached_prompt_tokens = 0  # of the prompts counted in the stats' num_prompt_tokens: the prefix cache's
        self._requests: dict[str, tuple[Sequence, IncrementalDetokenizer | None]] = {}
        # queue the next step before reading this one's tokens: on a GPU, where the host schedules while it computes
        overlap = options.overlap_steps
        self.overlap_steps = self.device.type == "cuda" if overlap is None else overlap
        self._in_flight: LaunchedStep | None = None  # a step queued on the device, collected by the next step()

    def close(self) -> None:
        """Stop a tensor-parallel engine's workers and free the model, its KV pool and its CUDA graphs, their device
        memory handed back to the GPU (not kept in torch's cache), so that an engine loaded next finds it free. The
        engine runs nothing after."""
        if self.ranks is not None:
            self.ranks.close()
        del self.model_runner
        self._in_flight = None
        gc.collect()  # what a reference cycle still holds
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenize and validate a request without touching engine state (safe from any thread)."""
        token_ids = encode_prompt(prompt, self.tokenizer, self.limits.vocab_size, bool(params.stop))
        return Sequence(request_id, token_ids, self.limits.taken(len(token_ids), params))

    def add_request(self, seq: Sequence) -> None:
        """Take a request made by ``make_request``, here or in another process (``engine_process``)."""
        if seq.request_id in self._requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use: pick a unique id")
        rotary = self.model_runner.model.rotary  # how its KV is rotated sets its prefix-cache salt (LongRoPE)
        seq.cache_salt, seq.recompute_at = rotary.cache_salt(seq.num_tokens), rotary.recompute_point(seq.num_tokens)
        if seq.recompute_at is not None:
            seq.recompute_salt = rotary.cache_salt(seq.recompute_at)
        if seq.params.structured_output is not None:
            seq.matcher = self.grammars.matcher(seq.params.structured_output)
        self.scheduler.add(seq)
        detokenizer = request_detokenizer(self.tokenizer, seq.prompt_token_ids, seq.params)
        self._requests[seq.request_id] = (seq, detokenizer)

    def abort_request(self, request_id: str) -> StreamDelta | None:
        """Finish a request with reason "abort", freeing its blocks; None if it is not (or no longer) here."""
        if request_id not in self._requests:
            return None
        seq, _ = self._requests[request_id]
        self.scheduler.finish(seq, "abort")
        return self._emit(seq, [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def interrupt(self) -> bool:
        """A step of this process's GPU work cannot be stopped from another thread; a tensor-parallel step waiting
        on a hung rank can: abort the collectives and kill the local workers."""
        if self.ranks is None:
            return False
        self.ranks.group.abort()
        self.ranks.stop_workers()
        return True

    @property
    def worker_pids(self) -> dict[int, int]:
        """The process ids, by rank, of the tensor-parallel workers this process started that still run (none for one
        device, nor for ranks that torchrun started)."""
        return {} if self.ranks is None or self.ranks.workers is None else self.ranks.workers.pids()

    def failure(self) -> KilnError | None:
        """A tensor-parallel worker that exited, which rank 0's watcher notices at once, even while idle."""
        if self.ranks is None or self.ranks.failure is None:
            return None
        return TensorParallelError(f"{self.ranks.failure}: the engine stopped")

    def warm_up_step(self) -> bool:
        """Capture one CUDA graph the load deferred (``RuntimeOptions.cuda_graph_capture``); False when none is left.
        Called while no request is in flight."""
        if self.has_unfinished():
            raise RuntimeError("warm_up_step is for an idle engine: a request is in flight")
        return self.model_runner.capture_next_graph()

    def step(self) -> list[StreamDelta | RequestFailure]:
        """One step: what each sampled request gained, or why it failed (the others are unaffected).

        With ``overlap_steps``, the next step is scheduled without knowing this one's tokens
        (``Scheduler.schedule_ahead``: decodes of the tokens in flight, prefill chunks, admissions) and queued behind
        it on the device before its tokens are read; the next call collects it. A request that finishes meanwhile
        (a stop token, an abort) drops what the queued step computed for it."""
        if self.ranks is None:
            return self._step()
        if (failure := self.failure()) is not None:
            raise failure
        try:
            return self._step()
        except Exception as e:
            if (failure := self.ranks.failure_after_error()) is None:
                raise
            raise TensorParallelError(f"{failure}: the engine stopped") from e

    def _step(self) -> list[StreamDelta | RequestFailure]:
        start = time.perf_counter()
        launched, self._in_flight = self._in_flight, None
        queued_ahead = launched is not None
        if not queued_ahead:
            out = self.scheduler.schedule()
            if not out.scheduled:
                self._record_step(out, time.perf_counter() - start, 0.0)
                return []
        execute_start = time.perf_counter()
        launched = launched or self.model_runner.launch(out)
        if self.overlap_steps and (ahead := self.scheduler.schedule_ahead(launched.out)) is not None:
            self._in_flight = self.model_runner.launch(ahead, after=launched)
        sampled = self.model_runner.collect(launched)
        logprobs = launched.logprobs(sampled)
        execute_s = time.perf_counter() - execute_start
        self.scheduler.update_computed(launched.out)
        now = time.monotonic()  # every token of the step reached the host together
        results, prompt_tokens, generated_tokens = [], 0, 0
        for seq, token_id in sampled.items():
            if seq.is_finished:  # aborted since it was launched
                continue
            results.append(result := self._postprocess(seq, token_id, now, logprobs.get(seq)))
            if not isinstance(token_id, SamplingError):  # vLLM's iteration tokens: each token, and a first's prompt
                # a token its format refused (the request failed on it) is no output
                generated_tokens += not isinstance(result, RequestFailure)
                if seq.num_completion_tokens == 1:
                    prompt_tokens += seq.num_prompt_tokens
                    self.num_cached_prompt_tokens += seq.num_cached_tokens
        if self._in_flight is not None and self._in_flight.sampling_deferred:
            self.model_runner.sample(self._in_flight)  # its structured outputs' matchers now have these tokens
        self.stats.record_tokens(prompt_tokens, generated_tokens)
        self._record_step(launched.out, time.perf_counter() - start, execute_s, queued_ahead,
                          prompt_tokens + generated_tokens)
        return results

    def _postprocess(self, seq: Sequence, token_id: int | SamplingError, now: float,
                     logprob: TokenLogprob | None) -> StreamDelta | RequestFailure:
        """The request's delta, or its failure when its token could not be sampled or postprocessing raised."""
        if isinstance(token_id, SamplingError):
            return self._fail(seq, token_id)
        try:
            return self._append_token(seq, token_id, now, logprob)
        except StructuredOutputError as e:  # the request's format, not a bug
            return self._fail(seq, e)
        except Exception as e:  # a bug: fail this request loudly, keep serving the others
            logger.error("request %s failed while postprocessing token %d", seq.request_id, token_id, exc_info=e)
            error = RequestFailedError(f"request {seq.request_id} failed in the engine ({type(e).__name__}: {e}); "
                                       f"other requests are unaffected: report this as a bug")
            error.__cause__ = e
            return self._fail(seq, error)

    def _fail(self, seq: Sequence, error: KilnError) -> RequestFailure:
        """Finish a failed request with reason "error" (vLLM V1's) and free its blocks."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        if self._requests.pop(seq.request_id, None) is not None:
            self.stats.record_finished(seq)
        return RequestFailure(seq.request_id, error)

    def _append_token(self, seq: Sequence, token_id: int, now: float, logprob: TokenLogprob | None) -> StreamDelta:
        """Append the sampled token and finish the sequence on a stop token, a stop string or max_tokens."""
        _, detokenizer = self._requests[seq.request_id]
        seq.append_token(token_id, now, logprob)
        if seq.matcher is not None:
            advance_matcher(seq.matcher, token_id, seq.request_id, seq.num_completion_tokens - 1)
        if (reason := finish_reason(seq, token_id, detokenizer, self.eos_token_ids, self.eos_token_id)) is not None:
            self.scheduler.finish(seq, reason)
        return self._emit(seq, [token_id])

    def _emit(self, seq: Sequence, new_token_ids: list[int]) -> StreamDelta:
        _, detokenizer = self._requests[seq.request_id]
        if seq.is_finished:
            del self._requests[seq.request_id]
            self.stats.record_finished(seq)
        return step_delta(seq, detokenizer, new_token_ids)

    def _record_step(self, out: SchedulerOutput, duration_s: float, execute_s: float, queued_ahead: bool = False,
                     iteration_tokens: int = 0) -> None:
        bm = self.block_manager
        self.stats.record_step(StepStats(
            step=self.stats.num_steps, num_seqs=len(out.scheduled), num_batched_tokens=out.num_batched_tokens,
            num_prefill_seqs=out.num_prefill_seqs, num_decode_seqs=out.num_decode_seqs,
            num_preempted=out.num_preempted, num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=bm.num_used_blocks, kv_blocks_free=bm.num_free_blocks,
            prefix_cache_hit_tokens=bm.prefix_cache_hit_tokens, duration_s=duration_s, execute_s=execute_s,
            queued_ahead=queued_ahead, num_iteration_tokens=iteration_tokens))

    def stats_snapshot(self) -> dict:
        """Engine counters and latency summaries, KV pool and prefix-cache state (safe from any thread)."""
        bm = self.block_manager
        queried = bm.prefix_cache_queried_tokens
        return {
            **self.stats.snapshot(),
            "load_phases_s": {**self.rank_load_times.seconds, **self.model_runner.load_times.seconds},
            "cuda_graphs": self.model_runner.graph_stats(),
            "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "kv_cache": {"num_blocks": bm.num_blocks, "block_size": bm.block_size, "used_blocks": bm.num_used_blocks,
                         "free_blocks": bm.num_free_blocks, "dtype": self.config.plan.kv_cache_dtype,
                         "prefix_caching": bm.prefix_caching},
            "prefix_cache": {"queried_tokens": queried, "hit_tokens": bm.prefix_cache_hit_tokens,
                             "hit_blocks": bm.prefix_cache_hit_blocks,
                             "hit_rate": bm.prefix_cache_hit_tokens / queried if queried else 0.0},
        }

