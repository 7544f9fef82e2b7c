"""Replay a benchmark row through the native engine's scheduler (the real ``Scheduler`` and ``BlockManager``, no
model) and price its steps with a cost model fitted to measured runs: admission policies and preemption costs
compared in seconds of CPU instead of minutes of GPU.

    python tools/simulate_scheduler.py 2048/2048 [--prompts 1000] [--pool-tokens 931712] [--block-size 32]
        [--max-batch-size 512] [--max-num-tokens 8192] [--policies guaranteed_no_evict,max_utilization]
        [--swap-ms-per-token MS --swap-gib GIB] [--json]

Every request arrives at once with its own prompt and generates exactly ``output`` tokens, as ``kiln bench`` runs a
row. A step costs, in ms, ``A + B x sequences + C x thousands of context tokens its sequences attend over`` plus, per
prompt token it computes, ``P0 + P1 x that token's position in thousands`` (the attention of a long prompt's later
tokens). The constants are a least-squares fit of the decode and mixed steps' seconds of eight runs on one H100 SXM
(Llama-3-8B shape, FP8 weights and KV, 2026-12-06: `bash tools/gpu_table.sh direct rows=R` with each policy, R in
128/2048, 500/2000, 1000/1000 and 2048/2048; docs/performance.md has the table and how close the fit comes).

``--swap-ms-per-token`` prices preemption by copying a sequence's KV to host memory and back instead of recomputing
it (a policy the engine does not have): the schedule is the same, but the tokens a preempted sequence computes again
cost that much each instead, while what is swapped fits in ``--swap-gib`` of host memory. A token's KV is 2 x layers
x KV heads x head dim bytes (64 KiB for this model in FP8): at about 25 GB/s each way over PCIe, 0.005 ms a token
for both copies.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kiln.runtime.limits import EngineLimits
from kiln.runtime.native.block_manager import BlockManager
from kiln.runtime.native.scheduler import Scheduler
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence

KV_BYTES_PER_TOKEN = 64 * 1024  # Llama-3-8B, FP8 KV: 2 x 32 layers x 8 KV heads x 128


@dataclass(frozen=True)
class StepCost:
    """The fitted constants, ms (see the module docstring)."""

    fixed: float = 2.119
    per_sequence: float = 0.01233
    per_thousand_context: float = 0.02345
    per_prompt_token: float = 0.01361
    per_prompt_token_per_thousand: float = 0.00064

    def __call__(self, num_seqs: int, context_tokens: int, prompt_chunks: list[tuple[int, int]]) -> float:
        """One step's ms: ``prompt_chunks`` are (first position, tokens) of the prompt tokens it computes."""
        prompt = sum(n * (self.per_prompt_token + self.per_prompt_token_per_thousand * (start + n / 2) / 1000)
                     for start, n in prompt_chunks)
        return (self.fixed + self.per_sequence * num_seqs + self.per_thousand_context * context_tokens / 1000
                + prompt)


class SwappingScheduler(Scheduler):
    """The scheduler, noting which preempted sequences' KV would fit in ``host_tokens`` of host memory: those are
    priced as copied back rather than computed again."""

    def __init__(self, limits: EngineLimits, block_manager: BlockManager, policy: str, host_tokens: int) -> None:
        super().__init__(limits, block_manager, policy)
        self.host_tokens = host_tokens
        self.swapped: dict[Sequence, int] = {}  # a sequence in host memory: its tokens with KV

    def preempt(self, seq: Sequence) -> None:
        held = seq.num_computed_tokens
        super().preempt(seq)
        if held and held <= self.host_tokens - sum(self.swapped.values()):
            self.swapped[seq] = held

    def copied_back(self, seq: Sequence, start: int, num_new: int) -> int:
        """How many of the ``num_new`` tokens from ``start`` that ``seq`` computes come back from host memory; its
        host memory is freed once all have."""
        held = self.swapped.get(seq, 0)
        if start + num_new >= held:
            self.swapped.pop(seq, None)
        return max(0, min(start + num_new, held) - start)


@dataclass
class Outcome:
    policy: str
    tokens_per_s: float
    seconds: float
    steps: int
    mixed_steps: int
    preemptions: int
    swapped_tokens: int


def simulate(input_len: int, output_len: int, prompts: int, policy: str, *, pool_tokens: int, block_size: int,
             max_batch_size: int, max_num_tokens: int, cost: Callable[[int, int, list[tuple[int, int]]], float],
             swap_ms_per_token: float | None = None,
             swap_gib: float = 0.0) -> Outcome:
    """Run ``prompts`` requests of ``input_len`` + ``output_len`` tokens to the end and price every step with
    ``cost(sequences, context tokens, prompt chunks)`` (a ``StepCost``)."""
    limits = EngineLimits(max_input_len=input_len, max_seq_len=input_len + output_len, max_batch_size=max_batch_size,
                          max_num_tokens=max_num_tokens, kv_pool_tokens=pool_tokens)
    host_tokens = int(swap_gib * 2**30 // KV_BYTES_PER_TOKEN) if swap_ms_per_token is not None else 0
    scheduler = SwappingScheduler(limits, BlockManager(pool_tokens // block_size, block_size), policy, host_tokens)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for i in range(prompts):  # distinct first tokens: no prefix is shared
        scheduler.add(Sequence(str(i), [i + 1] * input_len, params))
    ms = 0.0
    steps = mixed = swapped_tokens = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        chunks, swap_ms = [], 0.0
        for seq, num_new in out.scheduled.items():
            if num_new > 1 or seq.num_completion_tokens == 0:  # prompt tokens, or a preempted sequence's again
                copied = scheduler.copied_back(seq, seq.num_computed_tokens, num_new) if swap_ms_per_token else 0
                swapped_tokens += copied
                swap_ms += copied * (swap_ms_per_token or 0.0)
                if num_new > copied:
                    chunks.append((seq.num_computed_tokens + copied, num_new - copied))
        context = sum(seq.num_computed_tokens + n for seq, n in out.scheduled.items())
        ms += cost(len(out.scheduled), context, chunks) + swap_ms
        steps += 1
        mixed += bool(chunks)
        scheduler.update_computed(out)
        for seq in list(out.scheduled):
            if seq.num_computed_tokens == seq.num_tokens:  # its last token computed: it samples one more
                seq.append_token(1)
                if seq.num_completion_tokens >= output_len:
                    scheduler.finish(seq, "length")
    return Outcome(policy, round(prompts * output_len / (ms / 1000)), round(ms / 1000, 1), steps, mixed,
                   scheduler.num_preemptions, swapped_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("row", help="input/output tokens, e.g. 2048/2048")
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--pool-tokens", type=int, default=931_712, help="KV pool tokens (an H100's at the defaults)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=512)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--policies", default="guaranteed_no_evict,max_utilization")
    parser.add_argument("--swap-ms-per-token", type=float, help="price preemption as a swap to host memory")
    parser.add_argument("--swap-gib", type=float, default=16.0, help="host memory for swapped KV (with the above)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    input_len, output_len = (int(n) for n in args.row.split("/"))
    outcomes = [simulate(input_len, output_len, args.prompts, policy, pool_tokens=args.pool_tokens,
                         block_size=args.block_size, max_batch_size=args.max_batch_size,
                         max_num_tokens=args.max_num_tokens, cost=StepCost(),
                         swap_ms_per_token=args.swap_ms_per_token, swap_gib=args.swap_gib)
                for policy in args.policies.split(",")]
    if args.json:
        print(json.dumps([asdict(outcome) for outcome in outcomes], indent=2))
        return
    for o in outcomes:
        print(f"{args.row} x{args.prompts} {o.policy}: {o.tokens_per_s:,.0f} tok/s, {o.seconds} s, {o.steps} steps "
              f"({o.mixed_steps} with prompt tokens), {o.preemptions} preemptions, {o.swapped_tokens:,} tokens "
              f"swapped")


if __name__ == "__main__":
    main()
