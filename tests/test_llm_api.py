"""The public runtime API: generate, stream, submit/result, abort, stats, loading by path or cache key."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from kiln.runtime import LLM, KilnError, SamplingParams
from kiln.runtime.errors import EngineClosedError, EngineFormatError, FingerprintMismatchError, SamplingError
from kiln.runtime.limits import EngineLimits, RequestTooLongError
from kiln.runtime.native.engine import InvalidRequestError
from kiln.runtime.options import RuntimeOptions, RuntimeOptionsError
from kiln.runtime.outputs import RequestFailedError
from kiln.runtime.tokenizer import IncrementalDetokenizer
from tests.model_factories import build_tiny_engine, make_hf_model, tiny_plan
from tests.subprocess_env import REPO, repo_env
from tests.test_server_support import wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], list(range(30, 55))]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return build_tiny_engine(tmp_path_factory.mktemp("native"), plan=tiny_plan(max_seq_len=256))


@pytest.fixture(scope="module")
def llm(engine_dir):
    with LLM.load(engine_dir) as llm:
        yield llm


def all_blocks_free(llm: LLM) -> bool:
    kv = llm.stats()["kv_cache"]
    return kv["free_blocks"] == kv["num_blocks"]


@torch.inference_mode()
def test_greedy_tokens_match_transformers_generate_for_single_and_batched_prompts(llm):
    hf = make_hf_model(seed=0)
    expected = []
    for prompt in PROMPTS:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    assert llm.generate(PROMPTS[1], GREEDY)[0].token_ids == expected[1]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_loading_and_generating_leave_the_global_rng_alone(engine_dir):
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    with LLM.load(engine_dir) as llm:
        llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=4))
    assert torch.equal(torch.rand(4), expected)


def test_a_cuda_setting_for_an_engine_on_the_cpu_is_refused_at_load(engine_dir):
    with pytest.raises(KilnError, match="cuda_graphs=True: CUDA settings, and this engine runs on the cpu"):
        LLM.load(engine_dir, RuntimeOptions(device="cpu", cuda_graphs=True))


def test_a_kv_pool_that_cannot_be_allocated_is_a_kiln_error_naming_its_size(engine_dir):
    with pytest.raises(KilnError, match=r"KV pool of 1000000000000 blocks \([0-9.]+ GiB\) could not be allocated"):
        LLM.load(engine_dir, RuntimeOptions(num_kv_blocks=10**12))


@pytest.mark.parametrize(("prompts", "message"), [
    (None, "prompts must be text, token ids, or a list of those; got NoneType"),
    (b"t5 t6", "prompts must be text, token ids, or a list of those; got bytes"),
    ([b"t5 t6"], "a prompt is text .* or token ids .*, got bytes"),
])
def test_a_prompt_of_another_type_is_refused_naming_it(llm, prompts, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(prompts, GREEDY)


def test_token_ids_of_numpy_are_a_prompt_and_an_empty_one_is_invalid(llm):
    import numpy as np

    expected = llm.generate([5, 6, 7], GREEDY)[0].token_ids
    assert llm.generate(list(np.arange(5, 8)), GREEDY)[0].token_ids == expected
    assert llm.generate([torch.arange(5, 8).tolist(), list(np.arange(5, 8))], GREEDY)[1].token_ids == expected
    assert llm.generate([list(torch.arange(5, 8))], GREEDY)[0].token_ids == expected  # torch's 0-d tensors
    with pytest.raises(InvalidRequestError, match="are not ints"):
        llm.generate([[5, torch.tensor(True)]], GREEDY)
    with pytest.raises(InvalidRequestError, match="prompt token ids \\[True\\] are not ints"):
        llm.generate([[5, True]], GREEDY)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[]], GREEDY)


def test_vllms_dict_prompts_are_taken_as_their_text_or_token_ids(llm):
    expected = [o.token_ids for o in llm.generate([[5, 6, 7], "t5 t6"], GREEDY)]
    given = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt": "t5 t6"}], GREEDY)
    assert [o.token_ids for o in given] == expected
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0].token_ids == expected[0]
    with pytest.raises(InvalidRequestError, match=r"vLLM's 'prompt' \(text\) or 'prompt_token_ids'.*\['text'\]"):
        llm.generate([{"text": "t5"}], GREEDY)
    with pytest.raises(InvalidRequestError, match="none of vLLM's other prompt keys"):
        llm.generate([{"prompt": "t5", "cache_salt": "a"}], GREEDY)
    [carried] = llm.generate({"prompt_token_ids": [5, 6, 7], "prompt": "t5 t6 t7"}, GREEDY)  # vLLM's TokensPrompt
    assert (carried.token_ids, carried.prompt, carried.prompt_token_ids) == (expected[0], "t5 t6 t7", [5, 6, 7])


def test_text_prompt_round_trips_through_the_engine_tokenizer(llm):
    out = llm.generate("t5 t6 t7", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert out.prompt_token_ids == [5, 6, 7]
    assert out.token_ids == llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6,
                                                                     ignore_eos=True))[0].token_ids
    assert out.text == "".join(f" t{t}" for t in out.token_ids)
    assert out.finish_reason == "length"


def test_detokenize_false_returns_the_same_tokens_without_text(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids_only = llm.generate("t5 t6 t7", SamplingParams(**{**vars(params), "detokenize": False}))[0]
    out = llm.generate("t5 t6 t7", params)[0]
    assert ids_only.token_ids == out.token_ids and out.text and ids_only.text == ""


def test_stream_deltas_concatenate_to_the_final_text(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["t19 t20 t99"])

    async def collect():
        return [delta async for delta in llm.stream(PROMPTS[1], params)]

    deltas = asyncio.run(collect())
    final = deltas[-1].output
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert final.token_ids == llm.generate([PROMPTS[1]], params)[0].token_ids


def test_a_stream_nobody_reads_buffers_its_output_without_stalling_the_others(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    finished_while_unread = []

    async def read_late():
        unread = llm.stream_many([PROMPTS[0], PROMPTS[1]], params, on_finished=lambda: finished_while_unread.append(1))
        first = await anext(unread)
        others = await llm.generate_async(PROMPTS[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        while llm.stats()["num_running"]:  # the unread requests run to their end meanwhile
            await asyncio.sleep(0.01)
        # their last deltas reach this loop with the step that finished them, which may be just after num_running
        # drops: a request sent now is added after that step, so its answer comes after those deltas
        await llm.generate_async(PROMPTS[2], SamplingParams(temperature=0, max_tokens=1))
        assert finished_while_unread == [1]  # what a server releases the request's admission on
        rest = [batch async for batch in unread]
        return first, rest, others

    first, rest, others = asyncio.run(read_late())
    assert len(others.token_ids) == 30
    assert len(rest) == 1  # everything the reader missed arrives in one batch
    tokens = {0: [], 1: []}
    for index, delta in first + rest[0]:
        tokens[index] += delta.token_ids
    assert [tokens[0], tokens[1]] == [o.token_ids for o in llm.generate(PROMPTS[:2], params)]


def test_closing_a_stream_early_aborts_the_request_and_frees_its_blocks(llm):
    async def take_two():
        stream = llm.stream(PROMPTS[2], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        deltas = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return deltas

    aborted_before = llm.stats()["requests_finished"]["abort"]
    assert len(asyncio.run(take_two())) == 2
    wait_until(lambda: llm.stats()["requests_finished"]["abort"] == aborted_before + 1)
    assert all_blocks_free(llm)


def test_aborted_request_frees_all_of_its_blocks(llm):
    request_id = llm.submit(PROMPTS[2], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    wait_until(lambda: llm.stats()["kv_cache"]["used_blocks"] > 0)
    llm.abort(request_id)
    out = llm.result(request_id, timeout=10)
    assert out.finish_reason == "abort" and len(out.token_ids) < 200
    assert all_blocks_free(llm)


def test_a_result_that_times_out_can_be_waited_for_again(llm):
    request_id = llm.submit(PROMPTS[2], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    with pytest.raises(TimeoutError, match="runs on"):
        llm.result(request_id, timeout=0)
    assert len(llm.result(request_id, timeout=30).token_ids) == 64
    with pytest.raises(KeyError):  # collected once
        llm.result(request_id)


def test_concurrent_asyncio_requests_match_generate(llm):
    async def run_all():
        return await asyncio.gather(*(llm.generate_async(p, GREEDY) for p in PROMPTS))

    assert [o.token_ids for o in asyncio.run(run_all())] == [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_too_long_request_is_rejected_with_the_numbers(llm):
    with pytest.raises(RequestTooLongError, match=r"^prompt has 57 tokens .* max_input_len is 48"):
        llm.generate([list(range(3, 60))], GREEDY)
    with pytest.raises(RequestTooLongError, match=r"^prompts\[2\]: prompt has 57 tokens"):  # which of a batch
        llm.generate([[5, 6], [7], list(range(3, 60))], GREEDY)
    with pytest.raises(KilnError, match=r"\(40 tokens\) \+ max_tokens \(230\) = 270 exceeds .* max_seq_len \(256\)"):
        llm.submit(list(range(3, 43)), SamplingParams(max_tokens=230))
    with pytest.raises(ValueError, match="not ints in"):
        llm.generate([[5, 100000]], GREEDY)


def test_max_tokens_none_generates_up_to_the_end_of_the_context_as_in_vllm(llm):
    up_to_the_end = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    short, long = llm.generate([[5, 6, 7], list(range(3, 51))], up_to_the_end)  # max_seq_len 256
    assert (len(short.token_ids), short.finish_reason) == (253, "length") and len(long.token_ids) == 208
    with pytest.raises(ValueError, match="min_tokens must be an int in"):
        SamplingParams(max_tokens=None, min_tokens=-1)


def test_tokenizer_limits_and_check_describe_what_the_engine_accepts(llm):
    assert llm.tokenizer.encode("t5 t6 t7") == [5, 6, 7]
    assert llm.limits == EngineLimits(max_input_len=48, max_seq_len=256, max_batch_size=4, max_num_tokens=64,
                                      kv_pool_tokens=256 * 4, vocab_size=llm.engine.config.architecture.vocab_size)
    assert llm.limits.max_request_tokens == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        llm.limits.max_seq_len = 1024
    finished_before = sum(llm.stats()["requests_finished"].values())
    assert llm.check("t5 t6 t7", SamplingParams(max_tokens=200)) is None
    with pytest.raises(RequestTooLongError, match=r"max_input_len is 48"):
        llm.check(list(range(3, 60)))
    with pytest.raises(RequestTooLongError, match=r"\(3 tokens\) \+ max_tokens \(254\) = 257 exceeds"):
        llm.check([5, 6, 7], SamplingParams(max_tokens=254))
    with pytest.raises(InvalidRequestError, match="not ints in"):
        llm.check([5, 100000])
    assert sum(llm.stats()["requests_finished"].values()) == finished_before
    assert llm.stats()["num_waiting"] == 0 and all_blocks_free(llm)


def test_a_tiny_temperature_samples_greedily_instead_of_stopping_the_engine(llm):
    tiny = llm.generate(PROMPTS[0], SamplingParams(temperature=1e-300, max_tokens=12))[0]
    assert tiny.token_ids == llm.generate(PROMPTS[0], GREEDY)[0].token_ids


def test_a_request_that_cannot_be_sampled_fails_alone_and_the_engine_keeps_serving(llm, monkeypatch):
    from kiln.runtime.native import sampler

    def refusing(seed: int, device: torch.device) -> torch.Generator:
        if seed == 13:
            raise RuntimeError("a seed torch refuses")
        return make_generator(seed, device)

    make_generator = sampler.request_generator
    monkeypatch.setattr(sampler, "request_generator", refusing)
    expected = llm.generate(PROMPTS[1], GREEDY)[0].token_ids
    bad_params = SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True, seed=13)
    bad, good = llm.submit(PROMPTS[0], bad_params), llm.submit(PROMPTS[1], GREEDY)
    with pytest.raises(SamplingError, match="no token could be sampled"):
        llm.result(bad, timeout=10)
    assert llm.result(good, timeout=10).token_ids == expected
    assert all_blocks_free(llm)
    assert llm.generate(PROMPTS[1], GREEDY)[0].token_ids == expected


def test_params_changed_after_construction_are_checked_when_a_request_takes_them(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    params.logprobs = 5000
    with pytest.raises(ValueError, match="SamplingParams.logprobs must be None or an int in"):
        llm.generate(PROMPTS[0], params)
    params.logprobs, params.stop = None, "Tuesday"  # a string, as the constructor takes it
    assert llm.generate(PROMPTS[0], params)[0].token_ids == llm.generate(PROMPTS[0], GREEDY)[0].token_ids[:4]
    with pytest.raises(TypeError, match="params must be SamplingParams .* got dict"):
        llm.generate("a", {"max_tokens": 3})
    assert llm.stats()["num_waiting"] == 0 and all_blocks_free(llm)


def test_an_error_while_postprocessing_one_request_fails_only_that_request(llm, monkeypatch):
    expected = llm.generate(PROMPTS[1], GREEDY)[0].token_ids
    add_token = IncrementalDetokenizer.add_token

    def broken_for_boom(self, token_id):
        if "boom" in self._stop:
            raise ZeroDivisionError("a bug")
        return add_token(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", broken_for_boom)
    bad = llm.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=["boom"]))
    good = llm.submit(PROMPTS[1], GREEDY)
    with pytest.raises(RequestFailedError, match="ZeroDivisionError: a bug") as failure:
        llm.result(bad, timeout=10)
    assert isinstance(failure.value.__cause__, ZeroDivisionError)
    assert llm.result(good, timeout=10).token_ids == expected
    assert all_blocks_free(llm)


def test_cancelling_a_generate_async_task_aborts_it_and_the_engine_keeps_serving(llm):
    async def cancel_midway():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        task = asyncio.create_task(llm.generate_async(PROMPTS[2], params))
        while llm.stats()["kv_cache"]["used_blocks"] == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    aborted_before = llm.stats()["requests_finished"]["abort"]
    asyncio.run(cancel_midway())
    wait_until(lambda: llm.stats()["requests_finished"]["abort"] == aborted_before + 1)
    assert all_blocks_free(llm)
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids


def test_a_fork_of_the_process_is_refused_clearly_and_the_parents_engine_keeps_serving(llm):
    pid = os.fork()
    if pid == 0:  # the fork has no engine thread: before, a request waited for ever
        code = 1
        try:
            signal.alarm(30)
            refusals = []
            for call in (lambda: llm.generate("Hi", SamplingParams(max_tokens=2)), llm.wait_until_warm,
                         lambda: llm.result("any")):
                try:
                    call()
                except EngineClosedError as refused:
                    refusals.append("is a fork of it" in str(refused))
            code = 0 if refusals == [True] * 3 and "is a fork of it" in llm.engine_error else 2
            llm.close()  # the parent's engine is the parent's to free
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids


def test_a_generate_async_whose_event_loop_closed_is_aborted_not_run_to_max_tokens(llm):
    before = llm.stats()["num_generated_tokens"]
    loop = asyncio.new_event_loop()
    long = SamplingParams(max_tokens=llm.limits.max_seq_len - 8, ignore_eos=True)
    loop.create_task(llm.generate_async("Hi", long))
    loop.run_until_complete(asyncio.sleep(0.05))
    loop.close()
    wait_until(lambda: llm.stats()["num_running"] == 0 and llm.stats()["num_waiting"] == 0, timeout=60)
    assert llm.stats()["num_generated_tokens"] - before < long.max_tokens


def test_an_llm_is_not_pickled_into_another_process(llm):
    with pytest.raises(TypeError, match="LLM.load the engine there"):
        pickle.dumps(llm)


def test_an_llm_still_open_at_exit_frees_its_engine():
    script = ("from kiln.runtime import LLM\nfrom tests.test_engine_process import _IdleEngine\n"
              "class Engine(_IdleEngine):\n    def close(self):\n        print('engine closed', flush=True)\n"
              "llm = LLM(Engine())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=repo_env(),
                         timeout=120)
    assert out.returncode == 0 and out.stdout == "engine closed\n"  # before: weakref's own exit hook ran first


def test_stats_report_steps_kv_blocks_and_request_latencies(llm):
    llm.generate(PROMPTS, GREEDY)
    stats = llm.stats()
    assert stats["load_ms"] > 0 and stats["num_steps"] > 0
    assert stats["ttft_ms"]["count"] >= 3 and stats["itl_ms"]["p50"] > 0
    assert stats["kv_cache"]["num_blocks"] == 4 * 256 // 4
    assert stats["recent_steps"]["steps"][-1]["num_seqs"] >= 1
    metrics = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].metrics
    assert metrics.time_to_first_token > 0 and len(metrics.inter_token_latencies) == 4
    assert metrics.num_prompt_tokens == 3 and metrics.num_generated_tokens == 5


def test_a_cached_engine_is_held_while_loaded_and_a_missing_directory_is_refused(engine_dir, tmp_path):
    from kiln.engines.cache import CacheCorruptError, is_held

    entry = tmp_path / "v1" / "entries" / "ab" / ("ab" + "0" * 62)
    shutil.copytree(engine_dir, entry / "engine")
    (entry / "in_use.lock").touch()
    for manifest in (None, b"{not json", b"[]"):  # an entry without a readable manifest is not a finished build
        if manifest is not None:
            (entry / "manifest.json").write_bytes(manifest)
        with pytest.raises(CacheCorruptError, match="manifest.json is missing or unreadable"):
            LLM.load(entry / "engine")
        assert not is_held(entry)
    (entry / "manifest.json").write_text(json.dumps({"files": []}))
    with LLM.load(entry / "engine") as llm:
        assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids and is_held(entry)
    assert not is_held(entry)
    with pytest.raises(EngineFormatError, match="missing: not an engine directory"):
        LLM.load(tmp_path / "missing")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    with pytest.raises(EngineFormatError, match="a Hugging Face checkpoint .* build one from it with `kiln build`"):
        LLM.load(tmp_path / "checkpoint")


def test_engine_built_for_another_toolchain_is_refused(engine_dir, tmp_path):
    copy = shutil.copytree(engine_dir, tmp_path / "engine")
    config = json.loads((copy / "engine.json").read_text())
    config["fingerprint"]["torch"] = "1.0"
    (copy / "engine.json").write_text(json.dumps(config))
    with pytest.raises(FingerprintMismatchError, match="torch 1.0"):
        LLM.load(copy)


def _slow_down_close(engine: object) -> threading.Event:
    """Make ``engine.close`` take a while; the event is set once it has started."""
    real_close, closing = engine.close, threading.Event()

    def slow_close() -> None:
        closing.set()
        time.sleep(0.3)
        real_close()

    engine.close = slow_close
    return closing


def test_a_request_given_no_params_takes_the_models_generation_config_defaults_as_in_vllm(engine_dir, tmp_path,
                                                                                          caplog):
    engine = shutil.copytree(engine_dir, tmp_path / "engine")
    (engine / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 1}))
    with LLM.load(engine) as llm:
        greedy = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16))[0].token_ids
        assert llm.default_params == SamplingParams(temperature=0.7, top_k=1)
        assert [o.token_ids[:16] for o in llm.generate([PROMPTS[1]] * 3)] == [greedy] * 3  # top_k 1: the likeliest
    (engine / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with LLM.load(engine) as llm:  # kiln serve --generation-config vllm serves it: a warning, not a refusal
        assert llm.default_params == SamplingParams() and "generation_config.json" in caplog.text
    (engine / "generation_config.json").unlink()
    with LLM(model=str(engine)) as llm:  # vLLM's spelling of LLM.load
        assert llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16))[0].token_ids == greedy
    with pytest.raises(KilnError, match="KV"):  # options apply, given positionally too
        LLM(engine, RuntimeOptions(num_kv_blocks=1))
    for call, words in ((lambda: LLM(), "needs an engine"), (lambda: LLM(engine, model=engine), "once"),
                        (lambda: LLM(_NeverBusy(), RuntimeOptions()), "for loading"),
                        (lambda: LLM(model=12), "got int")):
        with pytest.raises(TypeError, match=words):
            call()


class _NeverBusy:
    def has_unfinished(self) -> bool:
        return False


def test_closed_llm_frees_its_engine_while_referenced_and_refuses_new_requests(engine_dir):
    import gc
    import weakref

    llm = LLM.load(engine_dir)
    llm.generate(PROMPTS[0], GREEDY)
    engine, finished = weakref.ref(llm.engine), sum(llm.stats()["requests_finished"].values())
    in_flight = llm.submit(PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True))
    closing = _slow_down_close(llm.engine)
    first = threading.Thread(target=llm.close)
    first.start()
    closing.wait(timeout=30)
    llm.close()  # a second close returns only once the first has freed the engine
    gc.collect()
    assert engine() is None  # the LLM, still referenced, no longer holds its engine
    first.join()
    assert sum(llm.stats()["requests_finished"].values()) == finished and llm.limits.max_seq_len == 256
    assert llm.tokenizer is not None and llm.stats()["num_running"] == llm.stats()["num_waiting"] == 0
    with pytest.raises(EngineClosedError):
        llm.result(in_flight, timeout=5)
    with pytest.raises(EngineClosedError):
        llm.generate(PROMPTS[0], GREEDY)
    with pytest.raises(EngineClosedError):
        llm.check(PROMPTS[0], GREEDY)


def test_a_close_interrupted_while_the_step_runs_fails_the_requests_and_the_next_close_frees_the_engine(engine_dir):
    import gc
    import weakref

    llm = LLM.load(engine_dir)
    engine = weakref.ref(llm.engine)
    in_flight = llm.submit(PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True))
    join = llm._thread.join

    def interrupted(timeout=None):  # Ctrl-C while close waits for the engine thread
        llm._thread.join = join
        raise KeyboardInterrupt
    llm._thread.join = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.close()
    with pytest.raises(EngineClosedError):  # none waits on the interrupted close (it had waited forever)
        llm.result(in_flight, timeout=5)
    llm.close()  # frees the engine (it had returned at once, the engine kept)
    gc.collect()
    assert engine() is None and llm.closed


def test_an_engine_whose_statistics_fail_is_still_freed_by_close(engine_dir, caplog):
    import gc
    import weakref

    llm = LLM.load(engine_dir)
    engine = weakref.ref(llm.engine)
    llm.engine.stats_snapshot = lambda: 1 / 0  # an engine in an error state
    llm.close()
    gc.collect()
    assert engine() is None and llm.stats()["load_ms"] == llm.load_ms
    assert "last statistics could not be read" in caplog.text


def test_a_stream_many_callback_that_raises_leaves_the_other_requests_on_its_loop_served(engine_dir, caplog):
    def broken() -> None:
        raise RuntimeError("the caller's bug")

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM.load(engine_dir) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
        step = llm.engine.step
        llm.engine.step = lambda: (time.sleep(0.3), step())[1]  # the requests below all join one step
        llm.submit([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))  # a step running while they are added

        async def run_all() -> list:
            async def drain() -> None:
                async for _ in llm.stream_many([PROMPTS[0]], params, on_finished=broken):
                    pass

            together = [llm.generate_async(p, params) for p in PROMPTS]  # finished in the same step as the stream
            return await asyncio.wait_for(asyncio.gather(drain(), *together), timeout=60)

        outputs = asyncio.run(run_all())[1:]
    assert [o.token_ids for o in outputs] == expected
    assert "delivering request" in caplog.text and "the caller's bug" in caplog.text


def test_a_bug_in_the_engine_fails_its_waiters_with_the_cause_and_logs_where_it_was(engine_dir, caplog):
    with LLM.load(engine_dir) as llm:
        def broken_step():
            raise IndexError("a bug")

        llm.engine.step = broken_step
        with pytest.raises(EngineClosedError, match="IndexError: a bug") as failed:
            llm.generate(PROMPTS[0], GREEDY)
    assert isinstance(failed.value.__cause__, IndexError)
    logged = [r for r in caplog.records if r.getMessage() == "the engine thread stopped"]
    assert logged and logged[0].exc_info[0] is IndexError  # the traceback, for whoever reads the log


def test_load_ms_leaves_out_importing_the_backends_modules(engine_dir, monkeypatch):
    from kiln.runtime import llm as llm_module

    clock = [0.0]
    monkeypatch.setattr(llm_module.time, "perf_counter", lambda: clock[0])
    real_loader = llm_module.engine_loader

    def importing_loader(path, options):  # the first import of torch: 100 s on the fake clock
        clock[0] += 100.0
        load = real_loader(path, options)

        def loading(path, options):  # the load itself: 2 s
            clock[0] += 2.0
            return load(path, options)
        return loading

    monkeypatch.setattr(llm_module, "engine_loader", importing_loader)
    with LLM.load(engine_dir) as llm:
        assert llm.load_ms == 2000.0


def test_an_embedders_mistakes_are_refused_by_name(engine_dir):
    with pytest.raises(RuntimeOptionsError, match="overlap_steps 'false' must be True or False"):
        RuntimeOptions(overlap_steps="false")
    with pytest.raises(TypeError, match="options must be a RuntimeOptions, got dict"):
        LLM.load(engine_dir, {"num_kv_blocks": 4})
    with LLM.load(engine_dir) as llm:

        async def one_text_to_stream_many():
            async for _ in llm.stream_many("Hi", SamplingParams(max_tokens=2)):
                pass

        with pytest.raises(InvalidRequestError, match="stream_many takes a list of prompts"):
            asyncio.run(one_text_to_stream_many())
        huge = SamplingParams(temperature=1e300, min_tokens=2, max_tokens=4, seed=1)
        assert len(llm.generate("Once upon a time", huge)[0].token_ids) == 4  # no NaN from -inf / inf
    assert llm.closed


def test_an_llm_left_open_with_requests_in_flight_closes_at_exit(engine_dir):
    code = ("import sys, time; from kiln import LLM, SamplingParams; llm = LLM.load(sys.argv[1]); "
            "[llm.submit('Once upon a time', SamplingParams(max_tokens=200, ignore_eos=True)) for _ in range(4)]; "
            "time.sleep(0.2); sys.exit(0)")
    done = subprocess.run([sys.executable, "-c", code, str(engine_dir)], env=repo_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_llm_dropped_without_close_is_collected_and_frees_its_engine(engine_dir):
    import gc
    import weakref

    llm = LLM.load(engine_dir)
    llm.generate("Once", SamplingParams(max_tokens=2))
    engine_closed = []
    llm.engine.close = lambda: engine_closed.append(True)  # what the finalizer calls, seen
    dropped = weakref.ref(llm)
    thread = llm._thread
    del llm
    wait_until(lambda: gc.collect() is not None and dropped() is None, timeout=30)  # once its idle wait ends
    assert engine_closed == [True]
    thread.join(timeout=30)
    assert not thread.is_alive() and thread not in threading.enumerate()


def test_vllms_call_keywords_are_taken_at_their_defaults_and_refused_otherwise(llm):
    expected = llm.generate("t5 t6", GREEDY)[0].token_ids
    taken = llm.generate(["t5 t6"], GREEDY, lora_request=None, priority=[np.int64(0)], tokenization_kwargs={})
    assert taken[0].token_ids == expected
    with pytest.raises(ValueError, match=r"vLLM's priority=\[1\] is not supported \(Kiln schedules requests first"):
        llm.generate(["t5 t6"], GREEDY, priority=[1])
    for content_format in ("openai", "string"):  # Kiln reads the template's use of the parts, as vLLM's "auto"
        with pytest.raises(ValueError, match=f"chat_template_content_format='{content_format}' is not supported"):
            llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template_content_format=content_format)
    with pytest.raises(TypeError, match="LLM.generate\\(\\) got an unexpected keyword argument 'chat_template'"):
        llm.generate(["t5"], GREEDY, chat_template="x")


@pytest.mark.parametrize(("argument", "words"), [
    ({"gpu_memory_utilization": 0.9}, r"RuntimeOptions\(gpu_memory_utilization=...\)"),
    ({"tensor_parallel_size": 2}, "set build.tp_size in the config"),
    ({"swap_space": 4}, "swaps no KV to the host"),
    ({"enable_lora": True}, r"no LoRA adapter: build an engine of the merged weights \(taken at False"),
    ({"no_such_argument": 1}, "'no_such_argument'$"),  # none of vLLM's: Python's own words
])
def test_vllms_engine_arguments_say_where_kiln_takes_them(tmp_path, argument, words):
    with pytest.raises(TypeError, match=words):  # before: a bare "unexpected keyword argument"
        LLM(model=tmp_path, **argument)


def test_vllms_engine_arguments_are_refused_all_at_once_and_taken_where_they_change_nothing(engine_dir):
    changes_nothing = dict(tensor_parallel_size=1, max_model_len=256, dtype="auto", enable_lora=False, revision=None,
                           quantization=None, kv_cache_dtype="auto", enable_prefix_caching=None)  # vLLM's defaults
    with pytest.raises(TypeError, match=r"arguments 'gpu_memory_utilization': .*; 'max_num_seqs': .*\(taken at None or "
                                        r"4, "
                                        r"which changes nothing\); 'load_format': .*; 'swap_space': [^;]*$"):
        LLM(model=engine_dir, gpu_memory_utilization=0.9, max_num_seqs=2, load_format="dummy", swap_space=4,
            **changes_nothing)


def test_vllms_enable_prefix_caching_is_taken_where_it_agrees_with_the_options(engine_dir):
    from kiln.runtime import RuntimeOptions

    LLM(model=engine_dir, enable_prefix_caching=True).close()  # prefix caching is on by default
    with pytest.raises(TypeError, match=r"'enable_prefix_caching': pass options=RuntimeOptions\(prefix_caching"):
        LLM(model=engine_dir, enable_prefix_caching=True, options=RuntimeOptions(prefix_caching=False))


def test_an_empty_engine_path_is_refused_not_read_as_the_current_folder():
    for empty in ("", " "):
        with pytest.raises(EngineFormatError, match="empty path"):  # before: ".: no engine.json"
            LLM.load(empty)


def test_transformers_tokenizer_methods_say_what_kilns_tokenizer_has_instead(llm):
    with pytest.raises(AttributeError, match="no transformers tokenizer.*ChatTemplate.from_dir"):
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    with pytest.raises(AttributeError, match="use tokenizer.vocabulary_entries"):
        llm.tokenizer.convert_ids_to_tokens([5])
    with pytest.raises(AttributeError, match=r"use tokenizer.token_id\(token\)"):
        llm.tokenizer.convert_tokens_to_ids(["t5"])
    with pytest.raises(AttributeError, match=r"token_id\(kiln.runtime.tokenizer_files.special_token_texts\(llm."
                                             r"engine_dir\)\['eos_token'\]\).*stops at the engine's EOS ids"):
        _ = llm.tokenizer.eos_token_id
    with pytest.raises(TypeError, match=r"not callable \(it is no transformers tokenizer\): use tokenizer.encode"):
        llm.tokenizer("t5")
    with pytest.raises(AttributeError, match="'Tokenizer' object has no attribute 'encodee'$"):
        llm.tokenizer.encodee("x")  # any other name: Python's own error
