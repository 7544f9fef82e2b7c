"""The workload of ``kiln bench`` (seeded random token-id prompts) and its measurement on a Kiln engine.

Every phase uses prompts of its own, so the prefix cache never serves one phase from another's blocks: a warm-up
batch (the shapes of the offline run's first two steps), a few single requests for time to first token, a few
single requests for batch-1 decode (one at a time; the median counts), and the ``--prompts`` requests of the
offline run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.pipeline.bench.common import rate
from kiln.runtime.native.engine_format import EngineConfig
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.stats import summarize

TTFT_REPEATS = 5
BATCH1_REPEATS = 3
WARMUP_PROMPTS = 8


def warmup_prompts(prompts: int, input_len: int, max_num_tokens: int, max_batch_size: int) -> int:
    """How many prompts the warm-up sends: at least WARMUP_PROMPTS, and enough for the offline run's first two
    steps (its prompts alone, then their decodes beside the next prompts), so that the kernels those steps
    specialise are compiled before the run is timed; never more than the run sends."""
    per_step = max(1, min(max_batch_size, max_num_tokens // input_len))
    return min(prompts, max(WARMUP_PROMPTS, 2 * per_step))


@dataclass(frozen=True)
class Workload:
    """Seeded random prompts of ``input_len`` token ids; every request generates ``output_len`` tokens."""

    input_len: int
    output_len: int
    prompts: list[list[int]]
    batch1: list[list[int]]
    ttft: list[list[int]]
    warmup: list[list[int]]

    @classmethod
    def make(cls, vocab_size: int, *, prompts: int, input_len: int, output_len: int, seed: int,
             warmup: int = WARMUP_PROMPTS) -> Workload:
        generator = torch.Generator().manual_seed(seed)

        def draw(n: int) -> list[list[int]]:
            return torch.randint(0, vocab_size, (n, input_len), generator=generator).tolist()

        return cls(input_len, output_len, prompts=draw(prompts), batch1=draw(BATCH1_REPEATS),
                   ttft=draw(TTFT_REPEATS), warmup=draw(min(prompts, warmup)))

    @classmethod
    def for_engine(cls, engine: EngineConfig, *, prompts: int, input_len: int, output_len: int,
                   seed: int) -> Workload:
        """The workload on ``engine``'s vocabulary, with a warm-up sized to its plan (``warmup_prompts``)."""
        plan = engine.plan
        return cls.make(engine.architecture.vocab_size, prompts=prompts, input_len=input_len, output_len=output_len,
                        seed=seed, warmup=warmup_prompts(prompts, input_len, plan.max_num_tokens, plan.max_batch_size))


def measure_kiln(engine_dir: Path, workload: Workload, options: RuntimeOptions, *, batch_1_only: bool,
                 on_loaded=None, progress=lambda _msg: None, offline_only: bool = False) -> dict:
    """Load time, median time to first token, median batch-1 decode tokens/s and offline output tokens/s
    (``offline_only``: the offline run alone, TTFT and batch-1 decode None).

    ``on_loaded(load_ms)`` is called once the engine is loaded (the caller records it in the cache stats)."""
    from kiln.runtime import LLM, SamplingParams

    progress("kiln: loading the engine")
    llm = LLM.load(engine_dir, options)
    if on_loaded is not None:
        on_loaded(llm.load_ms)
    try:
        if (llm.stats().get("cuda_graphs") or {}).get("pending"):  # the native engine on a GPU: captured while idle
            progress("kiln: waiting for the idle engine to capture its CUDA graphs")
        start = time.perf_counter()
        llm.wait_until_warm()
        warm_ms = (time.perf_counter() - start) * 1000
        def params(max_tokens: int) -> SamplingParams:
            # token ids only, as the peer's generate and TensorRT-LLM's executor return them
            return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)

        progress("kiln: warming up")
        llm.generate(workload.warmup, params(2))
        ttft, decode = [], []
        if not offline_only:
            progress("kiln: time to first token")
            ttft = [llm.generate([p], params(1))[0].metrics.time_to_first_token for p in workload.ttft]
            progress("kiln: batch-1 decode")
            for prompt in workload.batch1:
                metrics = llm.generate([prompt], params(workload.output_len))[0].metrics
                decode.append(rate(metrics.num_generated_tokens - 1, metrics.finished_time - metrics.first_token_time))
        result = {  # the offline run's keys are null when it does not run (--batch-1), so every report has them
            "output_tokens_per_s": None,
            "output_tokens": None,
            "offline_s": None,
            "offline_engine": None,
            "decode_tokens_per_s_batch1": statistics.median(decode) if decode else None,
            "ttft_ms": round(1000 * statistics.median(ttft), 3) if ttft else None,
            "load_ms": round(llm.load_ms, 2),
            "load_phases_s": llm.stats().get("load_phases_s"),
            "warm_ms": round(warm_ms, 2),
            "cuda_graphs": llm.stats().get("cuda_graphs"),
            "device": str(llm.engine.device) if hasattr(llm.engine, "device") else options.device,
            "kv_pool": kv_pool_report(llm),
        }
        if not batch_1_only:
            progress(f"kiln: offline run of {len(workload.prompts)} prompts")
            before = llm.stats()
            start = time.perf_counter()
            outputs = llm.generate(workload.prompts, params(workload.output_len))
            elapsed = time.perf_counter() - start
            result["offline_engine"] = offline_engine_stats(before, llm.stats())
            result["output_tokens_per_s"] = rate(sum(len(o.token_ids) for o in outputs), elapsed)
            result["output_tokens"] = sum(len(o.token_ids) for o in outputs)
            result["offline_s"] = round(elapsed, 4)
        return result
    finally:
        llm.close()


def kv_pool_report(llm) -> dict:
    """The KV pool the engine allocated at its default settings: blocks, tokens, how many sequences of max_seq_len
    it holds at once against max_batch_size, and (native engine) its bytes, of all tensor-parallel ranks and of one
    (``bytes_per_rank``, what each device holds, as vLLM reports its KV cache per GPU), against the device's
    memory."""
    import torch

    pool, limits = llm.stats()["kv_cache"], llm.limits
    blocks_per_seq = -(-limits.max_seq_len // pool["block_size"])
    report = {"blocks": pool["num_blocks"], "tokens": pool["num_blocks"] * pool["block_size"],
              "full_length_sequences": pool["num_blocks"] // blocks_per_seq, "max_batch_size": limits.max_batch_size}
    runner = getattr(llm.engine, "model_runner", None)
    if runner is not None:
        # every rank holds the same blocks (the fewest any rank fits) of its share of the KV heads: rank 0's bytes
        per_rank = sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer)
        ranks = runner.tp.size if runner.tp is not None else 1
        report.update(bytes=per_rank * ranks, bytes_per_rank=per_rank, ranks=ranks)
        if runner.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(runner.device)
            report.update(device_total_bytes=total, device_free_bytes=free, share_of_device=round(per_rank / total, 4))
    return report


def offline_engine_stats(before: dict, after: dict) -> dict:
    """What the engine did in the offline run: its steps, how many were queued behind the previous one on the
    device (``NativeEngine.step``), and its preemptions; per step kind (prefill, mixed, decode)
    the steps, their wall time and model time (on a GPU mostly the wait for it; the rest is host work); and the
    batch size, wall time and model time of its last steps (those of the recent-step ring the run took: the end
    of the run, where contexts are longest; none of the phases before it)."""
    steps = after["num_steps"] - before["num_steps"]
    ring = after["recent_steps"]["steps"]  # the engine's last steps, at most its history (256)
    last = ring[len(ring) - min(steps, len(ring)):]  # this run's
    by_kind = {}
    for kind, totals in after["steps_by_kind"].items():
        earlier = before["steps_by_kind"][kind]
        by_kind[kind] = {"steps": totals["steps"] - earlier["steps"],
                         "s": round(totals["duration_s"] - earlier["duration_s"], 6),
                         "execute_s": round(totals["execute_s"] - earlier["execute_s"], 6)}
    return {"steps": steps,
            "steps_queued_ahead": after["num_steps_queued_ahead"] - before["num_steps_queued_ahead"],
            "preemptions": after["num_preemptions"] - before["num_preemptions"],
            "by_kind": by_kind,
            "last_steps_batch_size_p50": summarize([step["num_seqs"] for step in last]).get("p50"),
            "last_steps_ms_p50": _p50_ms([step["duration_s"] for step in last]),
            "last_steps_execute_ms_p50": _p50_ms([step["execute_s"] for step in last])}


def _p50_ms(seconds: list[float]) -> float | None:
    """The median of ``seconds`` in ms, to the microsecond (None when there are none)."""
    p50 = summarize(seconds, 1000)["p50"]
    return None if p50 is None else round(p50, 3)
