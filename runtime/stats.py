"""Engine counters, a bounded ring of recent steps and recent request latencies, summarised on demand."""

from __future__ import annotations

import bisect
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from kiln.runtime.sequence import Sequence


@dataclass
class StepStats:
    """One engine step."""

    step: int
    num_seqs: int
    num_batched_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    num_preempted: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_cache_hit_tokens: int
    duration_s: float
    execute_s: float = 0.0  # of duration_s, running the model (on a GPU mostly waiting for it); the rest is host work
    queued_ahead: bool = False  # queued on the device behind the previous step, before its tokens were read
    # vLLM's iteration tokens: the prompts whose prefill finished in the step, whole (cached tokens too), and the
    # tokens the step sampled
    num_iteration_tokens: int = 0
    timestamp: float = field(default_factory=time.time)


class PhaseTimes:
    """Seconds spent in each named phase, in the order they ran (a load's weights, KV pool, graph captures)."""

    def __init__(self, wait: Callable[[], None] = lambda: None) -> None:
        self.seconds: dict[str, float] = {}
        self._wait = wait  # called at the end of each phase: a device's queued work belongs to the phase

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self._wait()
        self.seconds[name] = round(time.perf_counter() - start, 4)


STEP_KINDS = ("prefill", "mixed", "decode")
# upper bounds of the iteration-tokens histogram (vLLM's buckets); one more count holds the rest
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def step_kind(step: StepStats) -> str:
    """"prefill" (prompt tokens only), "decode" (one new token per sequence) or "mixed" (both in one step)."""
    if step.num_prefill_seqs and step.num_decode_seqs:
        return "mixed"
    return "prefill" if step.num_prefill_seqs else "decode"


def summarize(values: list[float], scale: float = 1.0, digits: int | None = None) -> dict:
    """count, mean, p50, p95, p99 and max of `values` times `scale` (empty: count 0, the rest None: the same keys),
    rounded to ``digits`` where given; percentiles interpolated between the two nearest values, as numpy's (and
    vLLM's benchmarks) compute them."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    ordered = sorted(v * scale for v in values)

    def pct(p: float) -> float:
        position = p / 100 * (len(ordered) - 1)
        below = int(position)
        above = min(below + 1, len(ordered) - 1)
        return ordered[below] + (ordered[above] - ordered[below]) * (position - below)

    figures = {"mean": statistics.fmean(ordered), "p50": pct(50), "p95": pct(95), "p99": pct(99), "max": ordered[-1]}
    return {"count": len(ordered), **{name: value if digits is None else round(value, digits)
                                      for name, value in figures.items()}}


class EngineStats:
    """Written by the engine thread, read from any thread."""

    def __init__(self, history: int = 256, latency_history: int = 4096) -> None:
        self._lock = threading.Lock()
        self.recent_steps: deque[StepStats] = deque(maxlen=history)
        self._ttft: deque[float] = deque(maxlen=latency_history)
        self._itl: deque[float] = deque(maxlen=latency_history)
        self._e2e: deque[float] = deque(maxlen=latency_history)
        self.num_steps = 0
        self.num_steps_queued_ahead = 0
        # per step kind: steps run, their wall time and the part spent running the model (the rest is host work)
        self.steps_by_kind = {kind: {"steps": 0, "duration_s": 0.0, "execute_s": 0.0} for kind in STEP_KINDS}
        self.num_batched_tokens = 0
        self.step_tokens_counts = [0] * (len(STEP_TOKEN_BUCKETS) + 1)  # steps by iteration tokens, per bucket
        self.num_iteration_tokens = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # vLLM's: a prompt's tokens, cached ones too, once its prefill completes
        self.num_generated_tokens = 0
        self.num_finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}

    def record_step(self, step: StepStats) -> None:
        with self._lock:
            self.recent_steps.append(step)
            self.num_steps += 1
            self.num_steps_queued_ahead += step.queued_ahead
            by_kind = self.steps_by_kind[step_kind(step)]
            by_kind["steps"] += 1
            by_kind["duration_s"] += step.duration_s
            by_kind["execute_s"] += step.execute_s
            self.num_batched_tokens += step.num_batched_tokens
            self.step_tokens_counts[bisect.bisect_left(STEP_TOKEN_BUCKETS, step.num_iteration_tokens)] += 1
            self.num_iteration_tokens += step.num_iteration_tokens
            self.num_preemptions += step.num_preempted

    def record_tokens(self, prompt_tokens: int, generated_tokens: int) -> None:
        """Count tokens as they are processed, as vLLM does each engine iteration: the prompts whose prefill
        completed (whole, cached tokens too) and the tokens generated."""
        with self._lock:
            self.num_prompt_tokens += prompt_tokens
            self.num_generated_tokens += generated_tokens

    def record_finished(self, seq: Sequence) -> None:
        with self._lock:
            self.num_finished[seq.finish_reason] += 1
            if seq.first_token_time is not None:
                self._ttft.append(seq.first_token_time - seq.arrival_time)
                self._e2e.append(seq.finished_time - seq.arrival_time)
            self._itl.extend(seq.inter_token_latencies)

    def snapshot(self) -> dict:
        """Counters, a summary of the recent steps, and TTFT / ITL / end-to-end latency summaries in ms."""
        with self._lock:  # copy under the lock the engine step takes; summarise after releasing it
            steps, ttft, itl, e2e = list(self.recent_steps), list(self._ttft), list(self._itl), list(self._e2e)
            counters = {"num_steps": self.num_steps, "num_steps_queued_ahead": self.num_steps_queued_ahead,
                        "num_mixed_steps": self.steps_by_kind["mixed"]["steps"],
                        "steps_by_kind": {kind: dict(totals) for kind, totals in self.steps_by_kind.items()},
                        "num_batched_tokens": self.num_batched_tokens,
                        "step_tokens_histogram": {"buckets": list(STEP_TOKEN_BUCKETS),
                                                  "counts": list(self.step_tokens_counts),
                                                  "sum": self.num_iteration_tokens},
                        "num_prompt_tokens": self.num_prompt_tokens, "num_generated_tokens": self.num_generated_tokens,
                        "num_preemptions": self.num_preemptions,
                        "requests_finished": dict(self.num_finished)}
        return {
            **counters,
            "recent_steps": {
                "batch_size": summarize([s.num_seqs for s in steps]),
                "batched_tokens": summarize([s.num_batched_tokens for s in steps]),
                "duration_ms": summarize([s.duration_s for s in steps], 1000),
                "execute_ms": summarize([s.execute_s for s in steps], 1000),
                "steps": [asdict(s) for s in steps],
            },
            "ttft_ms": summarize(ttft, 1000),
            "itl_ms": summarize(itl, 1000),
            "e2e_ms": summarize(e2e, 1000),
        }
