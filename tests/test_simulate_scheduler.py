"""tools/simulate_scheduler.py: the engine's scheduler replayed over a benchmark row, priced per step."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from simulate_scheduler import StepCost, simulate  # noqa: E402


def run(policy: str, **swap: float) -> object:
    return simulate(64, 64, 48, policy, pool_tokens=2048, block_size=16, max_batch_size=32, max_num_tokens=512,
                    cost=StepCost(), **swap)


def test_a_pool_too_small_for_every_full_sequence_preempts_only_under_max_utilization():
    no_evict, greedy = run("guaranteed_no_evict"), run("max_utilization")
    assert no_evict.preemptions == 0 and greedy.preemptions > 0


def test_swapped_preemptions_cost_less_than_recomputed_ones_on_the_same_schedule():
    recomputed = run("max_utilization")
    swapped = run("max_utilization", swap_ms_per_token=0.001, swap_gib=1.0)
    assert swapped.steps == recomputed.steps and swapped.swapped_tokens > 0
    assert swapped.tokens_per_s > recomputed.tokens_per_s
