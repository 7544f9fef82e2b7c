"""TensorRT-LLM executor iterations as Kiln engine steps: one ``StepStats`` per iteration that ran a batch, from the
``IterationStats`` of ``tensorrt_llm.bindings.executor`` 1.2 (its ``InflightBatchingStats`` and ``KvCacheStats``).

How the executor reports them (``executorImpl.cpp``'s execution loop): it posts an iteration's statistics as it
launches the batch, with ``iter`` the number of batches completed so far and ``iter_latency_ms`` the latency of the
batch before (milliseconds, from fetching its requests to syncing on its results), measured only then. So a batch
becomes a step once the post after it arrives. When its last request has gone it posts an idle iteration (no active
requests, latency 0.0, the same ``iter`` as the next batch's) before that latency is measured: the batch before it
becomes a step with the next busy post, whose latency is that batch's, so the last step before the executor idles is
recorded when the next request arrives.
"""

from __future__ import annotations

from typing import Any

from kiln.runtime.stats import StepStats


class IterationSteps:
    """Pairs each executor iteration that ran a batch with the latency the next busy iteration reports."""

    def __init__(self) -> None:
        self._pending: Any = None  # the latest iteration that ran a batch, its latency not yet reported

    def add(self, iteration: Any) -> StepStats | None:
        """The step that ``iteration``'s statistics complete (the batch before it), if any. The idle iteration
        (no active requests) completes none; one that scheduled and paused nothing ran no batch and is no step. A
        batch whose successor's statistics were lost (the executor keeps ITERATION_STATS_KEPT between drains) has
        no known latency and is not recorded, rather than recorded as 0 s."""
        if iteration.num_active_requests == 0:
            return None
        batch = iteration.inflight_batching_stats  # None only for static batching, which Kiln does not configure
        ran = batch is not None and (batch.num_scheduled_requests > 0 or batch.num_paused_requests > 0)
        pending, self._pending = self._pending, iteration if ran else None
        if pending is None or iteration.iter != pending.iter + 1:
            return None
        return iteration_step(pending, iteration.iter_latency_ms / 1000)


def iteration_step(iteration: Any, duration_s: float) -> StepStats:
    """One executor iteration as a step.

    - The whole iteration is the executor's (its C++ scheduling and the engine); Kiln's own host work runs on
      another thread, outside it, so all of it counts as running the model (``execute_s``).
    - ``num_preempted``: the requests the capacity scheduler paused in the iteration (only ``max_utilization``
      pauses, and only started requests, which go back to waiting for their context). A paused request frees its
      KV blocks and computes its context again when resumed, as vLLM's recompute preemption.
    - ``num_waiting``: the requests not yet taken in, and those taken in but not scheduled (waiting for KV blocks).
    - ``num_iteration_tokens``, vLLM's iteration tokens, approximated from counts: the prompt tokens the iteration
      computed (a chunked prompt counts chunk by chunk, and reused blocks' tokens not at all, where vLLM counts the
      whole prompt once its prefill finishes), plus a sampled token for each generation request and each context
      request (the statistics do not tell a prompt's last chunk, the only one that samples, from the others).
    - ``prefix_cache_hit_tokens`` is 0: block reuse is counted in blocks, partly reused blocks among them.
    """
    batch, kv = iteration.inflight_batching_stats, iteration.kv_cache_stats  # kv: None without a KV cache manager
    num_ctx, num_gen, scheduled = batch.num_context_requests, batch.num_gen_requests, batch.num_scheduled_requests
    return StepStats(step=iteration.iter, num_seqs=scheduled, num_batched_tokens=batch.num_ctx_tokens + num_gen,
                     num_prefill_seqs=num_ctx, num_decode_seqs=num_gen, num_preempted=batch.num_paused_requests,
                     num_waiting=iteration.num_queued_requests + max(0, iteration.num_active_requests - scheduled),
                     kv_blocks_used=0 if kv is None else kv.used_num_blocks,
                     kv_blocks_free=0 if kv is None else kv.free_num_blocks, prefix_cache_hit_tokens=0,
                     duration_s=duration_s, execute_s=duration_s,
                     num_iteration_tokens=batch.num_ctx_tokens + num_ctx + num_gen)
