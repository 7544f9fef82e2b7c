"""Overlapped steps (``RuntimeOptions(overlap_steps=True)``): the next step is queued before the current one's tokens
are read, its decodes' input ids taken from them on the device, waiting requests admitted into the seats of those
that end by length. Every request must come out exactly as when each step runs to completion first, whatever
finishes it (length, a stop token no one could predict, an abort), and no KV block may leak."""

from __future__ import annotations

import pytest

from kiln.engines.native.builder import build_native_engine
from kiln.runtime import SamplingParams
from kiln.runtime.native.engine import NativeEngine
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.outputs import RequestOutput
from tests.model_factories import make_hf_checkpoint, random_prompts, tiny_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    checkpoint = make_hf_checkpoint(tmp_path_factory.mktemp("overlap") / "checkpoint", seed=2)
    engine_dir = tmp_path_factory.mktemp("engine")
    build_native_engine(checkpoint, engine_dir, tiny_plan(max_batch_size=6), "float32")
    return engine_dir


def run(engine_dir, requests: list[tuple[list[int], SamplingParams]], overlap: bool, num_kv_blocks: int | None = None,
        abort: tuple[str, int] | None = None) -> tuple[dict[str, RequestOutput], NativeEngine]:
    """Every request's output, and the engine; ``abort`` = (request id, after that many steps)."""
    engine = NativeEngine(engine_dir, RuntimeOptions(overlap_steps=overlap, num_kv_blocks=num_kv_blocks))
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(engine.make_request(str(i), prompt, params))
    outputs, steps = {}, 0
    while engine.has_unfinished():
        outputs.update((d.request_id, d.output) for d in engine.step() if d.finished)
        steps += 1
        if abort is not None and steps == abort[1]:
            outputs[abort[0]] = engine.abort_request(abort[0]).output
    return outputs, engine


def mixed_requests(engine_dir) -> list[tuple[list[int], SamplingParams]]:
    """Lengths that end at different steps, a stop token met mid-run, seeded sampling with top-p, max_tokens 1."""
    p = random_prompts(6, seed=7, min_len=3, max_len=20)
    greedy = run(engine_dir, [(p[3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))], False)[0]
    stop_token = greedy["0"].token_ids[4]
    return [(p[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
            (p[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
            (p[2], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)),
            (p[3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_token])),
            (p[4], SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=14, ignore_eos=True)),
            (p[5], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))]


def summary(outputs: dict[str, RequestOutput]) -> dict[str, tuple[list[int], str]]:
    return {rid: (o.token_ids, o.finish_reason) for rid, o in outputs.items()}


def all_blocks_free(engine: NativeEngine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_overlapped_steps_give_every_request_what_step_by_step_gives(engine_dir):
    requests = mixed_requests(engine_dir)
    expected, plain = run(engine_dir, requests, overlap=False)
    got, overlapped = run(engine_dir, requests, overlap=True)
    assert summary(got) == summary(expected)
    assert got["3"].finish_reason == "stop" and len(got["3"].token_ids) < 12  # the stop token ended it early
    assert plain.stats.num_steps_queued_ahead == 0 and overlapped.stats.num_steps_queued_ahead > 5
    assert all_blocks_free(overlapped) and not overlapped.has_unfinished()


def test_mixed_steps_queued_ahead_admit_waiting_requests_and_match_step_by_step(engine_dir):
    """More requests than the 6 seats, prompts longer than the token budget: admissions into the seats of requests
    ending by length and chunked prefills are scheduled while the step before them is still in flight."""
    prompts = random_prompts(10, seed=11, min_len=3, max_len=60)
    requests = [(p, SamplingParams(temperature=0, max_tokens=2 + i % 5, ignore_eos=True))
                for i, p in enumerate(prompts)]
    expected, _ = run(engine_dir, requests, overlap=False)
    got, overlapped = run(engine_dir, requests, overlap=True)
    assert summary(got) == summary(expected)
    queued_mixed = [s for s in overlapped.stats.recent_steps if s.queued_ahead and s.num_prefill_seqs]
    assert len(queued_mixed) >= 3 and any(s.num_decode_seqs for s in queued_mixed)
    assert all_blocks_free(overlapped) and not overlapped.has_unfinished()


def test_overlapped_steps_with_preemption_match_step_by_step(engine_dir):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    requests = [(p, params) for p in random_prompts(5, seed=8, min_len=3, max_len=20)]
    expected, _ = run(engine_dir, requests, overlap=False, num_kv_blocks=24)
    got, overlapped = run(engine_dir, requests, overlap=True, num_kv_blocks=24)
    assert summary(got) == summary(expected)
    assert overlapped.stats.num_preemptions > 0 and overlapped.stats.num_steps_queued_ahead > 0
    assert all_blocks_free(overlapped)


def test_aborting_a_request_while_a_step_is_queued_leaves_the_others_unchanged(engine_dir):
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    requests = [(p, params) for p in random_prompts(3, seed=9, min_len=3, max_len=20)]
    expected, _ = run(engine_dir, requests, overlap=False)
    got, overlapped = run(engine_dir, requests, overlap=True, abort=("1", 6))
    assert got["1"].finish_reason == "abort" and len(got["1"].token_ids) < 15
    assert summary({rid: got[rid] for rid in ("0", "2")}) == summary({rid: expected[rid] for rid in ("0", "2")})
    assert overlapped.stats.num_steps_queued_ahead > 0 and all_blocks_free(overlapped)


@pytest.mark.parametrize(("overlap", "queued_ahead"), [(None, False), (True, True)])
def test_a_cpu_engine_returns_each_steps_tokens_before_computing_the_next_unless_told(engine_dir, overlap,
                                                                                      queued_ahead):
    # on a CPU a step "queued ahead" runs at once, before the current step's tokens are returned: a step of delay
    engine = NativeEngine(engine_dir, RuntimeOptions(overlap_steps=overlap))
    engine.add_request(engine.make_request("0", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)))
    assert [len(delta.token_ids) for delta in engine.step()] == [1]
    assert (engine._in_flight is not None) is queued_ahead
