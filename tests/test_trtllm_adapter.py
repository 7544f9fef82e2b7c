"""The TensorRT-LLM runtime adapter behind Kiln's LLM API, against a fake executor made from the recorded 1.2.1 names.

The fake `tensorrt_llm.bindings.executor` has only the classes, keywords, methods and enum values recorded in
engines/trtllm/contract, so an adapter that used anything else would fail here. Its executor streams scripted
tokens: 10, 11, 12, ... for each request, stopping at `end_id` when the script reaches it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import types
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import kiln.runtime.trtllm.engine as adapter
import kiln.runtime.trtllm.toolchain as toolchain
from kiln.engines.trtllm.contract import load_contract
from kiln.runtime.errors import EngineFormatError, FingerprintMismatchError, TrtllmUnavailableError
from kiln.runtime.limits import EngineLimits, RequestTooLongError
from kiln.runtime.llm import LLM
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.outputs import RequestFailedError, RequestFailure
from kiln.runtime.plan import BuildPlan
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from kiln.runtime.trtllm.engine import ITERATION_STATS_KEPT, TrtllmEngine, TrtllmRequestError
from kiln.runtime.trtllm.engine_info import TrtllmEngineInfo, is_trtllm_engine
from kiln.runtime.trtllm.iteration_steps import IterationSteps

RECORDED = load_contract()["python"]["tensorrt_llm.bindings.executor"]
H200 = {"device": "cuda", "gpu_name": "NVIDIA H200", "compute_capability": "9.0", "cuda": "12.9",
        "tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48"}
EOS = 1
WORDS = ["<unk>", "</s>", "the", "cat", "sat", "on", "mat", "and", "dog", "ran", "a", "b", "c", "d", "e", "f"]


class _Enum:
    def __init__(self, enum: str, name: str) -> None:
        self.name, self.enum = name, enum

    def __repr__(self) -> str:
        return f"{self.enum}.{self.name}"


def _strict_class(name: str) -> type:
    """A class whose constructor accepts only the recorded keyword names."""
    allowed = set(RECORDED[name]["kwargs"])

    def __init__(self, **kwargs):
        unknown = set(kwargs) - allowed
        assert not unknown, f"{name} has no keyword {sorted(unknown)} in TensorRT-LLM 1.2.1"
        self.__dict__.update(kwargs)

    return type(name, (), {"__init__": __init__})


class _Result:
    __slots__ = tuple(RECORDED["Result"]["attributes"])


class _Response:
    __slots__ = ("request_id", "client_id", "error_msg", "result")

    def __init__(self, request_id, result=None, error_msg=None):
        self.request_id, self.result, self.error_msg, self.client_id = request_id, result, error_msg, None

    def has_error(self):
        return self.error_msg is not None


class _KvCacheStats:
    __slots__ = tuple(RECORDED["KvCacheStats"]["attributes"])


class _IterationStats:
    __slots__ = tuple(RECORDED["IterationStats"]["attributes"])


class _InflightBatchingStats:
    __slots__ = tuple(RECORDED["InflightBatchingStats"]["attributes"])


def iteration_stats(active: int, queued: int = 0, used: int = 0, reused: int = 0, missed: int = 0,
                    num_blocks: int = 10, *, iter: int = 0, latency_ms: float = 0.0, context: int = 0,  # noqa: A002
                    gen: int = 0, ctx_tokens: int = 0, paused: int = 0) -> _IterationStats:
    """An executor iteration's statistics: its number, the latency of the iteration before it, its requests (the
    batch: `context` and `gen` requests, `ctx_tokens` prompt tokens, `paused` ones), and its KV pool of
    `num_blocks` blocks of 32 tokens."""
    kv = _KvCacheStats()
    kv.max_num_blocks, kv.used_num_blocks, kv.free_num_blocks = num_blocks, used, num_blocks - used
    kv.tokens_per_block, kv.reused_blocks, kv.missed_blocks = 32, reused, missed
    batch = _InflightBatchingStats()
    batch.num_scheduled_requests, batch.num_context_requests, batch.num_gen_requests = context + gen, context, gen
    batch.num_paused_requests, batch.num_ctx_tokens = paused, ctx_tokens
    stats = _IterationStats()
    stats.iter, stats.iter_latency_ms, stats.inflight_batching_stats = iter, latency_ms, batch
    stats.num_active_requests, stats.num_queued_requests, stats.kv_cache_stats = active, queued, kv
    return stats


class FakeExecutor:
    """Streams one scripted token per request per `await_responses`, with only the recorded methods. Each iteration
    with requests posts its statistics as the executor does: numbered by the batches completed before it, with the
    latency of the batch before it (a request holds one KV block); then one more, of the idle executor, once its
    last request has gone (the next batch's number, no latency: the last batch's comes with the next batch)."""

    instances: list[FakeExecutor] = []
    step_s = 0.001  # the time one engine iteration takes

    def __init__(self, model_path, model_type, executor_config):
        self.model_path, self.model_type, self.config = model_path, model_type, executor_config
        self.requests, self.cancelled, self.active, self.shut_down = {}, [], {}, False
        self.fail_ids: set[int] = set()
        self.iterations: list[_IterationStats] = []
        self.completed, self.latency_ms = 0, 0.0  # batches completed; the last one's latency, not yet posted
        self._iterations_lock = threading.Lock()
        FakeExecutor.instances.append(self)

    def enqueue_request(self, request):
        request_id = len(self.requests) + 100
        self.requests[request_id] = request
        self.active[request_id] = 0
        return request_id

    def await_responses(self, timeout=None):
        assert isinstance(timeout, timedelta)
        time.sleep(self.step_s)
        context = [r for r, produced in self.active.items() if produced == 0]
        batch = {"active": len(self.active), "used": len(self.active), "context": len(context),
                 "gen": len(self.active) - len(context),
                 "ctx_tokens": sum(len(self.requests[r].input_token_ids) for r in context)}
        responses = []
        for request_id, produced in list(self.active.items()):
            request = self.requests[request_id]
            if request_id in self.fail_ids:
                del self.active[request_id]
                responses.append(_Response(request_id, error_msg="CUDA error: out of memory"))
                continue
            token = 10 + produced if produced < 5 else EOS
            reason = None
            if request.end_id is not None and token == request.end_id:
                reason = "END_ID"
            elif produced + 1 >= request.max_tokens:
                reason = "LENGTH"
            result = _Result()
            result.output_token_ids = [[token]]
            result.is_final = reason is not None
            result.finish_reasons = [_Enum("FinishReason", reason or "NOT_FINISHED")]
            self.active[request_id] = produced + 1
            if reason:
                del self.active[request_id]
            responses.append(_Response(request_id, result))
        if responses:
            self._post(iteration_stats(**batch, iter=self.completed, latency_ms=self.latency_ms))
            self.completed, self.latency_ms = self.completed + 1, self.step_s * 1000
            if not self.active:
                self._post(iteration_stats(active=0, iter=self.completed))
        return responses

    def _post(self, stats: _IterationStats) -> None:
        with self._iterations_lock:
            self.iterations.append(stats)

    def get_latest_iteration_stats(self):
        assert not self.shut_down, "Shutdown called"  # the executor's own check
        with self._iterations_lock:
            drained, self.iterations = self.iterations, []
        return drained

    def cancel_request(self, id):  # noqa: A002 - the recorded keyword name
        self.cancelled.append(id)
        self.active.pop(id, None)

    def shutdown(self):
        self.shut_down = True


def fake_executor_module() -> types.ModuleType:
    module = types.ModuleType("tensorrt_llm.bindings.executor")
    for name, spec in RECORDED.items():
        if "values" in spec:
            setattr(module, name, types.SimpleNamespace(**{v: _Enum(name, v) for v in spec["values"]}))
        elif "kwargs" in spec:
            setattr(module, name, _strict_class(name))
    methods = set(RECORDED["Executor"]["methods"])
    assert {m for m in vars(FakeExecutor) if not m.startswith("_") and callable(getattr(FakeExecutor, m))} <= methods
    module.Executor = FakeExecutor
    return module


@pytest.fixture
def trtllm(monkeypatch) -> types.ModuleType:
    """The fake TensorRT-LLM 1.2.1 on an H200, installed where the adapter imports it from."""
    module = fake_executor_module()
    package = types.ModuleType("tensorrt_llm")
    package.bindings = types.ModuleType("tensorrt_llm.bindings")
    package.bindings.executor = module
    monkeypatch.setitem(sys.modules, "tensorrt_llm", package)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings", package.bindings)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings.executor", module)
    versions = {"tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48"}
    monkeypatch.setattr(toolchain, "package_version", versions.get)
    monkeypatch.setattr(adapter, "trtllm_machine_fingerprint", lambda: dict(H200))
    FakeExecutor.instances.clear()
    return module


@pytest.fixture
def engine_dir(tmp_path: Path) -> Path:
    """A TensorRT-LLM engine folder as the builder leaves it (the engine files themselves are never read here)."""
    path = tmp_path / "engine"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "rank0.engine").write_bytes(b"engine")
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    TrtllmEngineInfo(plan=BuildPlan(max_batch_size=8, max_input_len=64, max_seq_len=128, max_num_tokens=128,
                                    tokens_per_block=32, kv_cache_dtype="fp8"),
                     quantization={"format": "fp8", "kv_cache_dtype": "fp8"}, fingerprint=dict(H200),
                     eos_token_ids=[EOS], vocab_size=len(WORDS)).save(path)
    return path


def test_generate_through_the_llm_api_streams_tokens_until_the_engines_eos(trtllm, engine_dir):
    with LLM(TrtllmEngine(engine_dir, RuntimeOptions())) as llm:
        out = llm.generate("the cat", SamplingParams(max_tokens=20, temperature=0))[0]
    assert out.prompt_token_ids == [2, 3]
    assert out.token_ids == [10, 11, 12, 13, 14, EOS]
    assert out.text == " a b c d e"  # WordLevel decoding puts a space between words
    assert out.finish_reason == "stop"
    request = FakeExecutor.instances[0].requests[100]
    assert request.input_token_ids == [2, 3] and request.max_tokens == 20 and request.streaming is True
    assert request.end_id == EOS and request.stop_words == [[EOS]]
    assert request.sampling_config.top_k == 1 and request.output_config.exclude_input_from_output is True
    assert FakeExecutor.instances[0].cancelled == []


def test_the_executor_is_configured_for_inflight_batching_with_kv_block_reuse(trtllm, engine_dir):
    engine = TrtllmEngine(engine_dir, RuntimeOptions(num_kv_blocks=10))
    executor = FakeExecutor.instances[0]
    assert executor.model_path == engine_dir and executor.model_type.name == "DECODER_ONLY"
    config = executor.config
    assert config.batching_type.name == "INFLIGHT" and config.enable_chunked_context is True
    assert config.kv_cache_config.enable_block_reuse is True and config.kv_cache_config.max_tokens == 320
    assert config.scheduler_config.capacity_scheduler_policy.name == "GUARANTEED_NO_EVICT"  # the executor's default
    engine.close()
    assert executor.shut_down
    TrtllmEngine(engine_dir, RuntimeOptions(scheduler_policy="max_utilization")).close()
    assert FakeExecutor.instances[1].config.scheduler_config.capacity_scheduler_policy.name == "MAX_UTILIZATION"


def test_prefix_caching_off_turns_the_executors_kv_block_reuse_off(trtllm, engine_dir):
    TrtllmEngine(engine_dir, RuntimeOptions(prefix_caching=False)).close()
    assert FakeExecutor.instances[0].config.kv_cache_config.enable_block_reuse is False


def test_max_tokens_ends_with_length_and_sampling_parameters_are_translated(trtllm, engine_dir):
    with LLM(TrtllmEngine(engine_dir, RuntimeOptions())) as llm:
        params = SamplingParams(max_tokens=3, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=7)
        out = llm.generate([[2, 3, 4]], params)[0]
    assert (out.token_ids, out.finish_reason) == ([10, 11, 12], "length")
    sampling = FakeExecutor.instances[0].requests[100].sampling_config
    assert (sampling.top_k, sampling.top_p, sampling.min_p, sampling.temperature, sampling.seed) == (5, 0.9, 0.05,
                                                                                                    0.7, 7)


def test_a_drawn_request_without_filters_sends_them_off_not_unset_which_the_executor_reads_as_greedy(trtllm,
                                                                                                  engine_dir):
    with LLM(TrtllmEngine(engine_dir, RuntimeOptions())) as llm:
        llm.generate([[2, 3, 4]], SamplingParams(max_tokens=3, temperature=0.8))
    sampling = FakeExecutor.instances[0].requests[100].sampling_config
    assert (sampling.top_k, sampling.top_p, sampling.temperature) == (0, 1.0, 0.8)


def test_the_repetition_penalty_and_min_tokens_go_to_the_executor_and_what_it_lacks_is_refused(trtllm, engine_dir):
    with LLM(TrtllmEngine(engine_dir, RuntimeOptions())) as llm:
        llm.generate([[2, 3, 4]], SamplingParams(max_tokens=3, temperature=0, repetition_penalty=1.3, min_tokens=2))
        for asked in (dict(logprobs=2), dict(prompt_logprobs=0), dict(logit_bias={3: 5.0}),
                      dict(allowed_token_ids=[3, 4])):
            with pytest.raises(TrtllmRequestError, match=f"does not serve {next(iter(asked))}"):
                llm.generate([[2, 3, 4]], SamplingParams(**asked))
    sampling = FakeExecutor.instances[0].requests[100].sampling_config
    assert (sampling.repetition_penalty, sampling.min_tokens, sampling.top_k) == (1.3, 2, 1)


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_are_refused_as_the_executor_counts_the_prompt(trtllm, engine_dir, penalty):
    engine = TrtllmEngine(engine_dir, RuntimeOptions())
    with pytest.raises(TrtllmRequestError, match=f"{penalty}: .*counts the prompt's tokens.*use repetition_penalty"):
        engine.make_request("r", [2, 3], SamplingParams(**{penalty: 0.5}))


def test_min_tokens_is_refused_with_stop_ids_the_executor_would_not_hold_back(trtllm, engine_dir):
    info = TrtllmEngineInfo.load(engine_dir)
    replace(info, eos_token_ids=[EOS, 15]).save(engine_dir)  # a second EOS id, as Llama 3's generation config has
    engine = TrtllmEngine(engine_dir, RuntimeOptions())
    for params, early, held in ((SamplingParams(min_tokens=2), [15], "only the end id (1)"),
                                (SamplingParams(min_tokens=2, stop_token_ids=[4], ignore_eos=True), [4], "no token")):
        with pytest.raises(TrtllmRequestError) as info:
            engine.make_request("r", [2, 3], params)
        message = str(info.value)
        assert f"min_tokens 2 with stop token ids {early}" in message and f"holds back {held}" in message
    engine.make_request("r", [2, 3], SamplingParams(min_tokens=2, ignore_eos=True))  # nothing to hold back


def test_each_unseeded_drawn_sample_gets_a_seed_of_its_own_and_seeded_ones_keep_theirs(trtllm, engine_dir):
    with LLM(TrtllmEngine(engine_dir, RuntimeOptions())) as llm:
        llm.generate([[2, 3]], SamplingParams(max_tokens=1, n=4))
        llm.generate([[2, 3]], SamplingParams(max_tokens=1, n=2, seed=7))
        llm.generate([[2, 3]], SamplingParams(max_tokens=1, temperature=0))
    seeds = [r.sampling_config.seed for r in FakeExecutor.instances[0].requests.values()]
    assert len(set(seeds[:4])) == 4 and all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds[:4])
    assert seeds[4:] == [7, 8, None]


def test_a_stop_string_finishes_the_request_and_cancels_it_in_the_executor(trtllm, engine_dir):
    with LLM(TrtllmEngine(engine_dir, RuntimeOptions())) as llm:
        out = llm.generate("the", SamplingParams(max_tokens=20, temperature=0, stop=["c"]))[0]
    assert out.finish_reason == "stop" and out.text == " a b "
    assert FakeExecutor.instances[0].cancelled == [100]


def test_ignore_eos_sends_no_end_id(trtllm, engine_dir):
    with LLM(TrtllmEngine(engine_dir, RuntimeOptions())) as llm:
        out = llm.generate("the", SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == [10, 11, 12, 13, 14, EOS, EOS]
    request = FakeExecutor.instances[0].requests[100]
    assert request.end_id is None and request.stop_words is None


def test_stream_yields_deltas_and_closing_it_early_aborts_in_the_executor(trtllm, engine_dir, monkeypatch):
    monkeypatch.setattr(FakeExecutor, "step_s", 0.05)

    async def take_two(llm):
        deltas = []
        async for delta in llm.stream("the cat", SamplingParams(max_tokens=20, temperature=0)):
            deltas.append(delta)
            if len(deltas) == 2:
                break
        return deltas

    with LLM(TrtllmEngine(engine_dir, RuntimeOptions())) as llm:
        deltas = asyncio.run(take_two(llm))
        assert [d.token_ids for d in deltas] == [[10], [11]]
        deadline = time.monotonic() + 5
        while not FakeExecutor.instances[0].cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
    assert FakeExecutor.instances[0].cancelled == [100]


def test_an_executor_error_fails_only_that_request_and_is_reported_in_stats(trtllm, engine_dir):
    engine = TrtllmEngine(engine_dir, RuntimeOptions())
    FakeExecutor.instances[0].fail_ids.add(100)
    engine.add_request(engine.make_request("r1", [2, 3], SamplingParams(max_tokens=4)))
    engine.add_request(engine.make_request("r2", [2, 3], SamplingParams(max_tokens=4)))
    finished, failed = {}, {}
    while engine.has_unfinished():
        for result in engine.step():
            if isinstance(result, RequestFailure):
                failed[result.request_id] = result.error
            elif result.finished:
                finished[result.request_id] = result.output
    assert list(failed) == ["r1"] and "CUDA error: out of memory" in str(failed["r1"])
    assert finished["r2"].finish_reason == "length"
    assert engine.stats_snapshot()["recent_errors"] == ["r1: CUDA error: out of memory"]


def test_the_waiter_of_a_request_the_executor_failed_gets_the_error(trtllm, engine_dir):
    with LLM(TrtllmEngine(engine_dir, RuntimeOptions())) as llm:
        FakeExecutor.instances[0].fail_ids.add(100)
        with pytest.raises(RequestFailedError, match="CUDA error: out of memory"):
            llm.generate([[2, 3]], SamplingParams(max_tokens=4))
        assert llm.generate([[2, 3]], SamplingParams(max_tokens=4))[0].finish_reason == "length"


def test_the_llm_api_describes_the_engine_through_tokenizer_limits_and_check(trtllm, engine_dir):
    with LLM(TrtllmEngine(engine_dir, RuntimeOptions())) as llm:
        assert llm.tokenizer.encode("the cat") == [2, 3]
        assert llm.limits == EngineLimits(max_input_len=64, max_seq_len=128, max_batch_size=8, max_num_tokens=128,
                                          vocab_size=len(WORDS))
        assert llm.limits.max_request_tokens == 128
        llm.check("the cat", SamplingParams(max_tokens=100))
        with pytest.raises(RequestTooLongError, match="max_input_len is 64"):
            llm.check([2] * 65)
    assert FakeExecutor.instances[0].requests == {}


def test_requests_that_do_not_fit_the_engine_are_refused_before_the_executor(trtllm, engine_dir):
    engine = TrtllmEngine(engine_dir, RuntimeOptions())
    with pytest.raises(RequestTooLongError, match="max_input_len is 64"):
        engine.make_request("r", [2] * 65, SamplingParams(max_tokens=1))
    with pytest.raises(RequestTooLongError, match=r"= 130 exceeds the engine's max_seq_len \(128\)"):
        engine.make_request("r", [2] * 30, SamplingParams(max_tokens=100))
    with pytest.raises(TrtllmRequestError, match="not ints in"):
        engine.make_request("r", [2, 99], SamplingParams())
    assert FakeExecutor.instances[0].requests == {}


def test_an_engine_built_for_another_toolchain_or_gpu_is_refused_naming_each_difference(trtllm, engine_dir,
                                                                                       monkeypatch):
    monkeypatch.setattr(adapter, "trtllm_machine_fingerprint",
                        lambda: {**H200, "tensorrt_llm": "1.2.0", "compute_capability": "8.9", "gpu_name": "L40S"})
    with pytest.raises(FingerprintMismatchError) as info:
        TrtllmEngine(engine_dir, RuntimeOptions())
    message = str(info.value)
    assert "tensorrt_llm '1.2.1' at build time, '1.2.0' here" in message
    assert "compute_capability '9.0' at build time, '8.9' here" in message
    assert "gpu_name 'NVIDIA H200' at build time, 'L40S' here" in message
    assert FakeExecutor.instances == []


def test_without_a_gpu_or_without_tensorrt_llm_loading_says_what_to_do(trtllm, engine_dir, monkeypatch):
    with pytest.raises(TrtllmUnavailableError, match="CUDA GPUs only"):
        TrtllmEngine(engine_dir, RuntimeOptions(device="cpu"))
    monkeypatch.setattr(toolchain, "package_version", lambda dist: None)
    with pytest.raises(TrtllmUnavailableError, match=r"pip install 'tensorrt-llm>=1.2,<1.3'"):
        TrtllmEngine(engine_dir, RuntimeOptions())
    monkeypatch.setattr(toolchain, "package_version", lambda dist: "1.3.0rc5")
    with pytest.raises(TrtllmUnavailableError, match="supports 1.2.x only"):
        TrtllmEngine(engine_dir, RuntimeOptions())
    monkeypatch.setattr(toolchain, "package_version", lambda dist: "1.2.1")
    monkeypatch.setattr(adapter, "trtllm_machine_fingerprint", lambda: {**H200, "device": "cpu"})
    with pytest.raises(TrtllmUnavailableError, match="no CUDA GPU is visible"):
        TrtllmEngine(engine_dir, RuntimeOptions())


def test_options_of_the_native_engine_are_refused_not_ignored(trtllm, engine_dir):
    with pytest.raises(TrtllmUnavailableError, match=r"kernels='torch', overlap_steps=False: .* native engine"):
        TrtllmEngine(engine_dir, RuntimeOptions(kernels="torch", overlap_steps=False))
    with pytest.raises(TrtllmUnavailableError, match=r"gpu_memory_utilization=0.95: .* native engine"):
        TrtllmEngine(engine_dir, RuntimeOptions(gpu_memory_utilization=0.95))
    with pytest.raises(TrtllmUnavailableError, match=r"attention_fp8_pv=False: .* native engine"):
        TrtllmEngine(engine_dir, RuntimeOptions(attention_fp8_pv=False))  # XQA multiplies in FP8 over an FP8 cache
    assert FakeExecutor.instances == []


def test_a_native_engine_folder_is_not_taken_for_a_tensorrt_llm_engine(tmp_path):
    (tmp_path / "engine.json").write_text("{}")
    assert not is_trtllm_engine(tmp_path)
    with pytest.raises(EngineFormatError, match="not a Kiln TensorRT-LLM engine"):
        TrtllmEngineInfo.load(tmp_path)


def test_importing_runtime_and_the_adapter_does_not_import_tensorrt_llm():
    code = ("import kiln.runtime, kiln.runtime.trtllm.engine, sys; "
            "print('tensorrt_llm' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["False", "False"]



def test_stats_report_the_executors_queue_and_kv_pool_as_of_its_latest_iteration(trtllm, engine_dir):
    engine = TrtllmEngine(engine_dir, RuntimeOptions())
    assert not {"num_waiting", "kv_cache", "prefix_cache"} & set(engine.stats_snapshot())  # before its first iteration
    executor = FakeExecutor.instances[0]
    executor.iterations.append(iteration_stats(active=1))
    executor.iterations.append(iteration_stats(active=2, queued=1, used=6, reused=3, missed=1))
    stats = engine.stats_snapshot()
    assert (stats["num_running"], stats["num_waiting"]) == (2, 1)
    assert stats["kv_cache"] == {"num_blocks": 10, "block_size": 32, "used_blocks": 6, "free_blocks": 4,
                                 "dtype": "fp8", "prefix_caching": True}
    assert stats["prefix_cache"] == {"hit_blocks": 3, "missed_blocks": 1, "hit_rate": 0.75}
    assert engine.stats_snapshot()["kv_cache"]["used_blocks"] == 6  # the executor's queue is drained; the latest kept
    engine.close()
    assert engine.stats_snapshot()["num_waiting"] == 1  # a shut-down executor is not asked


def test_stats_count_tokens_as_they_arrive_and_a_prompt_with_its_first_tokens(trtllm, engine_dir):
    engine = TrtllmEngine(engine_dir, RuntimeOptions())
    engine.add_request(engine.make_request("r1", [2, 3], SamplingParams(max_tokens=20, temperature=0)))
    engine.add_request(engine.make_request("r2", [2, 3, 4], SamplingParams(max_tokens=20, temperature=0)))
    engine.abort_request("r2")  # before its first token: neither its prompt nor any token is counted
    counts = []
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats_snapshot()
        counts.append((stats["num_prompt_tokens"], stats["num_generated_tokens"]))
    assert counts == [(2, n) for n in range(1, 7)]  # a b c d e and the EOS, each counted as it arrived


def test_each_executor_iteration_that_ran_a_batch_is_a_step_counting_vllms_iteration_tokens(trtllm, engine_dir):
    engine = TrtllmEngine(engine_dir, RuntimeOptions())
    assert FakeExecutor.instances[-1].config.iter_stats_max_iterations == ITERATION_STATS_KEPT  # never 0: steps on
    for request_id in ("r1", "r2"):  # the executor idles between them
        engine.add_request(engine.make_request(request_id, [2, 3], SamplingParams(max_tokens=20, temperature=0)))
        while engine.has_unfinished():
            engine.step()
            stats = engine.stats_snapshot()  # a stats read drains the iterations too: each is recorded once
        if request_id == "r1":  # its last batch's latency comes with r2's first batch
            assert stats["num_steps"] == 5
    assert sorted(stats) == ["backend", "e2e_ms", "itl_ms", "kv_cache", "num_batched_tokens", "num_generated_tokens",
                             "num_mixed_steps", "num_preemptions", "num_prompt_tokens", "num_running", "num_steps",
                             "num_steps_queued_ahead", "num_waiting", "prefix_cache", "recent_errors", "recent_steps",
                             "requests_finished", "step_tokens_histogram", "steps_by_kind", "ttft_ms"]
    assert stats["num_steps"] == 11  # r1's prefill and five decodes, r2's but its last; the idle iterations none
    assert [k["steps"] for k in stats["steps_by_kind"].values()] == [2, 0, 9]  # prefill, mixed, decode
    assert stats["num_batched_tokens"] == 2 * (2 + 5) - 1
    histogram = stats["step_tokens_histogram"]
    assert histogram["counts"][:2] == [9, 2] and histogram["sum"] == 2 * 8 - 1  # each prompt with its first token
    assert histogram["sum"] == stats["num_prompt_tokens"] + stats["num_generated_tokens"] - 1
    assert {step["duration_s"] for step in stats["recent_steps"]["steps"]} == {FakeExecutor.step_s}  # none is 0 s


def test_an_iteration_becomes_a_step_once_its_latency_arrives_and_is_taken_once():
    steps = IterationSteps()
    first = iteration_stats(2, queued=3, used=4, iter=7, context=1, gen=1, ctx_tokens=30, paused=1)
    assert steps.add(first) is None
    step = steps.add(iteration_stats(1, iter=8, latency_ms=12.5, gen=1))
    assert (step.step, step.duration_s, step.execute_s) == (7, 0.0125, 0.0125)
    assert (step.num_seqs, step.num_prefill_seqs, step.num_decode_seqs, step.num_batched_tokens) == (2, 1, 1, 31)
    assert (step.num_preempted, step.num_waiting, step.kv_blocks_used, step.kv_blocks_free) == (1, 3, 4, 6)
    assert step.num_iteration_tokens == 30 + 1 + 1
    assert steps.add(iteration_stats(1, iter=10, latency_ms=9.0, gen=1)) is None  # 9's latency, not 8's: 9 is lost
    assert steps.add(iteration_stats(0, iter=11)) is None  # the idle executor's: 10's latency comes with the next
    assert steps.add(iteration_stats(1, iter=11, latency_ms=4.0, gen=1)).duration_s == 0.004


def test_metrics_of_a_served_engine_answer_with_the_kv_pool_of_the_executors_latest_iteration(trtllm, engine_dir):
    labels = 'engine="0",model_name="trt"'
    with LLM(TrtllmEngine(engine_dir, RuntimeOptions())) as llm, \
            ServerThread(create_app(llm, engine_dir, ServerSettings(model_name="trt"))) as server:
        before = httpx.get(f"{server.url}/metrics")
        FakeExecutor.instances[0].iterations.append(iteration_stats(active=2, queued=1, used=6))
        after = httpx.get(f"{server.url}/metrics").text.splitlines()
    assert before.status_code == 200 and "kiln_engine_up 1.0" in before.text
    assert f"vllm:num_requests_running{{{labels}}} 0.0" in before.text
    assert "kiln_kv_blocks_used" not in before.text and "vllm:kv_cache_usage_perc" not in before.text  # none yet
    assert {"kiln_kv_blocks_used 6.0", "kiln_kv_blocks_free 4.0", "kiln_queue_depth 1.0",
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.6", f"vllm:num_requests_waiting{{{labels}}} 1.0"} <= set(after)
