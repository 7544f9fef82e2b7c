"""TensorRT-LLM executor iterations as Kiln engine steps: one ``StepStats`` per iteration that ran a batch, from the
``IterationStats`` of ``tensorrt_llm.bindings.executor`` 1.2 (its ``InflightBatchingStats`` and ``KvCacheStats``).

The executor measures an iteration's latency (``iter_latency_ms``, milliseconds: from fetching its new requests to
syncing on its batch) only in its next loop, and reports it in the next iteration's statistics; so a batch becomes a
step once the statistics after it arrive. The iteration it posts when its last request has gone reports no latency
(0.0), so the last step before the executor idles reads 0 s.
"""

from __future__ import annotations

from typing import Any

from kiln.runtime.stats import StepStats


class IterationSteps:
    """Pairs each executor iteration that ran a batch with the latency its successor reports."""

    def __init__(self) -> None:
        self._last_iter: int | None = None  # the latest iteration number seen: statistics are taken once
        self._pending: Any = None  # the latest iteration that ran a batch, its latency not yet reported

    def add(self, iteration: Any) -> StepStats | None:
        """The step that ``iteration``'s statistics complete (the batch before it), if any. An iteration seen
        before is ignored; one that scheduled and paused nothing (the one posted once the last request has gone,
        or one with every request waiting) ran no batch and is no step."""
        if self._last_iter is not None and iteration.iter <= self._last_iter:
            return None
        self._last_iter = iteration.iter
        batch = iteration.inflight_batching_stats  # None only for static batching, which Kiln does not configure
        ran = batch is not None and (batch.num_scheduled_requests > 0 or batch.num_paused_requests > 0)
        pending, self._pending = self._pending, iteration if ran else None
        if pending is None:
            return None
        latency_ms = iteration.iter_latency_ms if iteration.iter == pending.iter + 1 else 0.0  # else: one was lost
        return iteration_step(pending, latency_ms / 1000)


def iteration_step(iteration: Any, duration_s: float) -> StepStats:
    """One executor iteration as a step.

    - The whole iteration is the executor's (its C++ scheduling and the engine); Kiln's own host work runs on
      another thread, outside it, so all of it counts as running the model (``execute_s``).
    - ``num_preempted``: the requests the capacity scheduler paused in the iteration (only ``max_utilization``
      pauses). A paused request frees its KV blocks and computes its context again when resumed, as vLLM's
      recompute preemption.
    - ``num_iteration_tokens``, vLLM's iteration tokens, approximated from counts: the prompt tokens the iteration
      computed (a chunked prompt counts chunk by chunk, and reused blocks' tokens not at all, where vLLM counts the
      whole prompt once its prefill finishes), plus a sampled token for each generation request and each context
      request (the statistics do not tell a prompt's last chunk, the only one that samples, from the others).
    - ``prefix_cache_hit_tokens`` is 0: block reuse is counted in blocks, partly reused blocks among them.
    """
    batch, kv = iteration.inflight_batching_stats, iteration.kv_cache_stats  # kv: None without a KV cache manager
    num_ctx, num_gen = batch.num_context_requests, batch.num_gen_requests
    return StepStats(step=iteration.iter, num_seqs=batch.num_scheduled_requests,
                     num_batched_tokens=batch.num_ctx_tokens + num_gen, num_prefill_seqs=num_ctx,
                     num_decode_seqs=num_gen, num_preempted=batch.num_paused_requests,
                     num_waiting=iteration.num_queued_requests,
                     kv_blocks_used=0 if kv is None else kv.used_num_blocks,
                     kv_blocks_free=0 if kv is None else kv.free_num_blocks, prefix_cache_hit_tokens=0,
                     duration_s=duration_s, execute_s=duration_s,
                     num_iteration_tokens=batch.num_ctx_tokens + num_ctx + num_gen)
