"""In-flight batching end to end: joining a running batch, concurrency, preemption, prefix caching, chunking."""

from __future__ import annotations

import threading

import pytest

from kiln.engines.native.builder import build_native_engine
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.native.engine import NativeEngine
from kiln.runtime.options import RuntimeOptions
from tests.model_factories import make_hf_checkpoint, random_prompts, tiny_plan

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("native") / "checkpoint", seed=1)


def build(checkpoint, tmp_path_factory, **plan):
    engine_dir = tmp_path_factory.mktemp("engine")
    build_native_engine(checkpoint, engine_dir, tiny_plan(**plan), "float32")
    return engine_dir


@pytest.fixture(scope="module")
def engine_dir(checkpoint, tmp_path_factory):
    return build(checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def solo(engine_dir):
    """Each prompt's tokens when it runs alone on a fresh engine."""
    cache: dict[tuple, list[int]] = {}

    def run(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            with LLM.load(engine_dir) as llm:
                cache[tuple(prompt)] = llm.generate([prompt], PARAMS)[0].token_ids
        return cache[tuple(prompt)]

    return run


@pytest.mark.parametrize("overlap", [False, True], ids=["step-by-step", "overlapped"])
def test_request_arriving_during_decode_joins_the_running_batch(engine_dir, solo, overlap):
    engine = NativeEngine(engine_dir, RuntimeOptions(overlap_steps=overlap))
    first, second = random_prompts(2, seed=2, min_len=8)
    engine.add_request(engine.make_request("first", first, PARAMS))
    outputs = {}
    for step in range(200):
        if step == 3:
            engine.add_request(engine.make_request("second", second, PARAMS))
        outputs.update((d.request_id, d.output) for d in engine.step() if d.finished)
        if not engine.has_unfinished():
            break
    steps = list(engine.stats.recent_steps)
    joined = 4 if overlap else 3  # overlapped, step 3 was queued on the device before the request arrived
    assert (steps[joined].num_decode_seqs, steps[joined].num_prefill_seqs) == (1, 1)
    assert all((s.num_decode_seqs, s.num_prefill_seqs) == (1, 0) for s in steps[1:joined])
    by_kind = engine.stats.steps_by_kind  # the first step prefills alone, the joining one mixes, the rest decode
    assert by_kind["prefill"]["steps"] == 1 and by_kind["mixed"]["steps"] >= 1
    assert sum(k["steps"] for k in by_kind.values()) == engine.stats.num_steps == len(steps)
    assert by_kind["decode"]["steps"] == sum(1 for s in steps if s.num_prefill_seqs == 0)
    assert sum(k["duration_s"] for k in by_kind.values()) == pytest.approx(sum(s.duration_s for s in steps))
    assert outputs["first"].token_ids == solo(first) and outputs["second"].token_ids == solo(second)


@pytest.mark.parametrize("overlap", [False, True], ids=["step-by-step", "overlapped"])
def test_token_counters_grow_each_step_of_a_running_request_not_only_when_it_finishes(engine_dir, overlap):
    engine = NativeEngine(engine_dir, RuntimeOptions(overlap_steps=overlap))
    prompt = random_prompts(1, seed=7, min_len=8)[0]
    engine.add_request(engine.make_request("r", prompt, PARAMS))
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(delta.token_ids) for delta in engine.step())
        stats = engine.stats_snapshot()  # as vLLM counts: the prompt, whole, with its first token; each token
        assert (stats["num_prompt_tokens"], stats["num_generated_tokens"]) == (len(prompt) if generated else 0,
                                                                               generated)
        assert stats["step_tokens_histogram"]["sum"] == stats["num_prompt_tokens"] + generated
    assert generated == PARAMS.max_tokens


def test_concurrent_thread_requests_give_exactly_their_solo_results(engine_dir, solo):
    prompts = random_prompts(8, seed=3)
    expected = [solo(p) for p in prompts]
    results: list[list[int] | None] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    with LLM.load(engine_dir) as llm:
        def worker(i: int) -> None:
            barrier.wait()
            results[i] = llm.generate([prompts[i]], PARAMS)[0].token_ids

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert llm.stats()["recent_steps"]["batch_size"]["max"] > 1
    assert results == expected


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_small_kv_pool_preempts_and_every_request_still_matches_its_solo_run(engine_dir, solo, policy):
    prompts = random_prompts(4, seed=4, min_len=20, max_len=30)
    with LLM.load(engine_dir, RuntimeOptions(num_kv_blocks=20, scheduler_policy=policy)) as llm:
        outputs = llm.generate(prompts, PARAMS)
        stats = llm.stats()
    assert (stats["num_preemptions"] > 0) == (policy == "max_utilization")  # reserving full lengths evicts none
    assert [o.token_ids for o in outputs] == [solo(p) for p in prompts]
    assert sum(o.metrics.num_preemptions for o in outputs) == stats["num_preemptions"]
    # a preempted request finding its own blocks again is no prefix-cache hit: these prompts share none
    assert stats["prefix_cache"]["queried_tokens"] == sum(map(len, prompts))
    assert stats["prefix_cache"]["hit_tokens"] == 0 and all(o.metrics.num_cached_tokens == 0 for o in outputs)


def test_shared_prefix_is_served_from_cached_blocks(engine_dir, solo):
    prefix = random_prompts(1, seed=5, min_len=17, max_len=17)[0]
    first, second = prefix + [10, 11, 12], prefix + [20, 21]
    with LLM.load(engine_dir) as llm:
        out_first = llm.generate([first], PARAMS)[0]
        out_second = llm.generate([second], PARAMS)[0]
        prefix_cache = llm.stats()["prefix_cache"]
    assert out_first.metrics.num_cached_tokens == 0
    assert out_second.metrics.num_cached_tokens == 16
    assert prefix_cache["hit_tokens"] == 16 and prefix_cache["hit_blocks"] == 4
    assert out_first.token_ids == solo(first) and out_second.token_ids == solo(second)


def test_with_prefix_caching_off_a_shared_prefix_is_computed_again_and_looked_up_nowhere(engine_dir, solo):
    prefix = random_prompts(1, seed=5, min_len=17, max_len=17)[0]
    first, second = prefix + [10, 11, 12], prefix + [20, 21]
    with LLM.load(engine_dir, RuntimeOptions(prefix_caching=False)) as llm:
        outputs = [llm.generate([prompt], PARAMS)[0] for prompt in (first, second)]
        prefix_cache = llm.stats()["prefix_cache"]
    assert [out.metrics.num_cached_tokens for out in outputs] == [0, 0]
    assert prefix_cache["queried_tokens"] == 0 and prefix_cache["hit_tokens"] == 0  # as vLLM reports with it off
    assert [out.token_ids for out in outputs] == [solo(first), solo(second)]


def test_a_request_whose_prompt_logprobs_bypass_the_prefix_cache_is_no_lookup(engine_dir):
    prompt = random_prompts(1, seed=5, min_len=17, max_len=17)[0]
    with LLM.load(engine_dir) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))
        assert llm.stats()["prefix_cache"]["queried_tokens"] == 0
        llm.generate([prompt], PARAMS)
        assert llm.stats()["prefix_cache"]["queried_tokens"] == len(prompt)


def test_prompt_longer_than_the_token_budget_is_prefilled_in_chunks(checkpoint, tmp_path_factory, solo):
    prompt = random_prompts(1, seed=6, min_len=40, max_len=40)[0]
    with LLM.load(build(checkpoint, tmp_path_factory, max_num_tokens=12)) as llm:
        output = llm.generate([prompt], PARAMS)[0]
        steps = llm.stats()["recent_steps"]["steps"]
    assert [s["num_batched_tokens"] for s in steps[:4]] == [12, 12, 12, 4]
    assert all(s["num_batched_tokens"] <= 12 for s in steps)
    assert output.token_ids == solo(prompt)
