"""In-flight batching policy, checked without a model: a fake step marks tokens computed and samples token 0."""

from __future__ import annotations

import random

import pytest

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.limits import EngineLimits, RequestTooLongError
from kiln.runtime.native.block_manager import BlockManager
from kiln.runtime.native.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.plan import BuildPlan
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence, SequenceStatus

BLOCK = 4


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                   max_seq_len: int = 64, policy: str = "max_utilization") -> Scheduler:
    plan = BuildPlan(max_batch_size=max_num_seqs, max_input_len=max_seq_len, max_seq_len=max_seq_len,
                     max_num_tokens=max_num_batched_tokens, tokens_per_block=BLOCK)
    return Scheduler(EngineLimits.from_plan(plan, kv_pool_tokens=num_blocks * BLOCK), BlockManager(num_blocks, BLOCK),
                     policy)


def request(num_prompt: int, max_tokens: int = 4, first_token: int = 1) -> Sequence:
    return Sequence(f"r{first_token}", list(range(first_token, first_token + num_prompt)),
                    SamplingParams(max_tokens=max_tokens))


def fake_step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step without a model: every sequence that reached its last token samples token 0."""
    out = scheduler.schedule()
    finishing = [seq for seq, n in out.scheduled.items() if seq.num_computed_tokens + n == seq.num_tokens]
    scheduler.update_computed(out)
    for seq in finishing:
        seq.append_token(0)
        if seq.num_completion_tokens >= seq.params.max_tokens:
            scheduler.finish(seq, "length")
    return out


def test_running_decodes_come_first_and_new_prefills_fill_the_rest_of_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    old = request(6, max_tokens=10)
    scheduler.add(old)
    fake_step(scheduler)
    new = request(20, first_token=100)
    scheduler.add(new)
    out = fake_step(scheduler)
    assert out.scheduled == {old: 1, new: 9}
    assert (out.num_decode_seqs, out.num_prefill_seqs) == (1, 1)


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    seq = request(20)
    scheduler.add(seq)
    chunks = [fake_step(scheduler).scheduled[seq] for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert seq.num_completion_tokens == 1


def test_waiting_requests_are_admitted_in_arrival_order_without_skipping_the_head():
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    first, big, small = request(12, first_token=1), request(16, first_token=50), request(2, first_token=90)
    for seq in (first, big, small):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert list(out.scheduled) == [first]
    assert list(scheduler.waiting) == [big, small]


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [request(3, first_token=10 * i) for i in range(1, 4)]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert list(out.scheduled) == seqs[:2] and scheduler.waiting[0] is seqs[2]


def test_preemption_evicts_the_latest_arrival_and_requeues_it_first():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64, max_seq_len=16)
    early, late = request(7, max_tokens=8, first_token=1), request(7, max_tokens=8, first_token=50)
    queued = request(7, max_tokens=8, first_token=90)  # arrived after both: it waits for blocks throughout
    scheduler.add(early)
    scheduler.add(late)
    scheduler.add(queued)
    fake_step(scheduler)
    fake_step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 0 and early.num_computed_tokens == 8
    out = fake_step(scheduler)
    assert out.num_preempted == 1 and list(out.scheduled) == [early]
    assert late.status is SequenceStatus.WAITING and list(scheduler.waiting) == [late, queued]
    assert late.block_table == [] and late.num_computed_tokens == 0 and late.num_preemptions == 1
    assert scheduler.num_preemptions == 1


def test_preemption_evicts_the_latest_of_three_running():
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64, max_seq_len=16)
    seqs = [request(7, max_tokens=8, first_token=1 + 30 * i) for i in range(3)]  # two blocks each, then a third
    for seq in seqs:
        scheduler.add(seq)
    fake_step(scheduler)
    fake_step(scheduler)  # each now needs a third block, and none is free
    out = fake_step(scheduler)
    assert out.num_preempted == 1 and seqs[2].status is SequenceStatus.WAITING
    assert list(out.scheduled) == seqs[:2]


def test_every_decode_fits_a_budget_of_exactly_their_number():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=3)
    seqs = [request(1, max_tokens=8, first_token=10 * i) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    fake_step(scheduler)
    assert fake_step(scheduler).scheduled == dict.fromkeys(seqs, 1)


def test_guaranteed_no_evict_admits_a_request_only_when_every_running_one_can_reach_its_max_tokens():
    scheduler = make_scheduler(num_blocks=9, max_num_batched_tokens=64, max_seq_len=16, policy="guaranteed_no_evict")
    seqs = [request(7, max_tokens=8, first_token=1 + 30 * i) for i in range(3)]  # 15 tokens: 4 blocks each in the end
    for seq in seqs:
        scheduler.add(seq)
    out = fake_step(scheduler)
    assert list(out.scheduled) == seqs[:2] and list(scheduler.waiting) == [seqs[2]]  # 2 x 4 of 9 blocks reserved
    assert scheduler.block_manager.num_free_blocks == 5  # though only 4 are taken so far
    while seqs[0].status is not SequenceStatus.FINISHED:
        assert fake_step(scheduler).num_preempted == 0 and seqs[2].status is SequenceStatus.WAITING
    fake_step(scheduler)
    assert seqs[2].status is SequenceStatus.RUNNING and scheduler.num_preemptions == 0


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_every_request_finishes_under_block_pressure(policy):
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=12, max_num_seqs=6, max_num_batched_tokens=16, max_seq_len=40,
                               policy=policy)
    pending = [request(rng.randint(1, 24), max_tokens=rng.randint(1, 12), first_token=100 * i) for i in range(30)]
    everyone = list(pending)
    steps = 0
    while pending or scheduler.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                scheduler.add(pending.pop(0))
        out = fake_step(scheduler)
        assert sum(out.scheduled.values()) <= 16 and all(n > 0 for n in out.scheduled.values())  # the token budget
        steps += 1
        assert steps < 2000, "a request starved"
    assert all(s.finish_reason == "length" and s.num_completion_tokens == s.params.max_tokens for s in everyone)
    assert (scheduler.num_preemptions > 0) == (policy == "max_utilization")  # reserving full lengths evicts none
    assert scheduler.block_manager.num_free_blocks == 12


@pytest.mark.parametrize(("num_prompt", "max_tokens", "num_blocks", "error", "words"), [
    (0, 4, 64, InvalidRequestError, "empty"),
    (70, 1, 64, RequestTooLongError, "max_input_len"),
    (60, 10, 64, RequestTooLongError, r"max_seq_len \(64\)"),
    (20, 10, 4, RequestTooLongError, "request of 30 tokens does not fit the KV pool of 16 tokens"),
])
def test_request_that_can_never_fit_is_rejected_at_add(num_prompt, max_tokens, num_blocks, error, words):
    scheduler = make_scheduler(num_blocks=num_blocks)
    with pytest.raises(error, match=words):
        scheduler.add(request(num_prompt, max_tokens=max_tokens))
    assert not scheduler.has_unfinished()


def test_finishing_a_waiting_request_removes_it():
    scheduler = make_scheduler()
    seq = request(5)
    scheduler.add(seq)
    scheduler.finish(seq, "abort")
    assert not scheduler.has_unfinished() and seq.finish_reason == "abort"


def test_a_mixed_step_lists_its_decodes_before_its_prefills():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    short, long = request(3, max_tokens=8), request(20, first_token=100)  # the short one arrives first
    scheduler.add(short)
    scheduler.add(long)
    fake_step(scheduler)  # short's prompt and long's first chunk
    later = request(20, max_tokens=8, first_token=200)
    scheduler.add(later)
    fake_step(scheduler)  # short decodes, long's second chunk, later's first tokens
    fake_step(scheduler)  # long's last chunk samples: long and short decode next, later still prefills
    out = fake_step(scheduler)
    kinds = [seq.is_decode for seq in out.scheduled]
    assert kinds == sorted(kinds, reverse=True) and kinds[0] and not kinds[-1]  # decodes lead (the kernels' split)
    assert out.num_decode_seqs == kinds.count(True)


def test_a_prefix_hit_schedules_only_the_tokens_after_the_cached_blocks():
    scheduler = make_scheduler()
    first = request(9, max_tokens=1, first_token=0)  # tokens 0..8: blocks [0..3] and [4..7] get cached
    scheduler.add(first)
    fake_step(scheduler)
    second = Sequence("s", [0, 1, 2, 3] + list(range(50, 57)), SamplingParams(max_tokens=1))  # 11 tokens, 1 block hit
    scheduler.add(second)
    assert scheduler.schedule().scheduled == {second: 7}


def test_scheduling_ahead_gives_the_seat_of_a_request_ending_by_length_to_a_waiting_one():
    scheduler = make_scheduler(max_num_seqs=1)
    ending, waiting = request(4, max_tokens=1), request(4, first_token=100)
    scheduler.add(ending)
    scheduler.add(waiting)
    out = scheduler.schedule()  # ending's prompt: its one token is in flight
    ahead = scheduler.schedule_ahead(out)
    assert ahead is not None and list(ahead.scheduled) == [waiting]


def test_a_step_scheduled_ahead_counts_the_tokens_in_flight_as_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    sampled, chunked = request(3, max_tokens=8), request(20, first_token=100)
    scheduler.add(sampled)
    scheduler.add(chunked)
    out = scheduler.schedule()  # sampled's whole prompt (its first token in flight), chunked's first 5 tokens
    ahead = scheduler.schedule_ahead(out)
    assert ahead.scheduled == {sampled: 1, chunked: 7} and list(ahead.scheduled) == [sampled, chunked]
    assert (ahead.num_decode_seqs, ahead.num_prefill_seqs) == (1, 1)


def test_the_sequence_cap_holds_past_256_sequences():
    scheduler = make_scheduler(num_blocks=320, max_num_seqs=300, max_num_batched_tokens=400)  # past interned ints
    for i in range(301):
        scheduler.add(request(1, first_token=i))
    assert len(scheduler.schedule().scheduled) == 300 and len(scheduler.waiting) == 1
