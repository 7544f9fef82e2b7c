"""Preflight refuses, before any build, what TensorRT-LLM 1.2.x would reject at load time, and says why."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kiln.engines.trtllm.preflight import TrtllmPreflightError, preflight
from kiln.pipeline.config import BuildSection
from kiln.pipeline.stages import trtllm_build_options
from kiln.runtime.plan import BuildPlan

H200 = {"gpu_name": "NVIDIA H200", "compute_capability": "9.0"}
A100 = {"gpu_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}
OPTIONS = trtllm_build_options(BuildSection(), BuildPlan(max_batch_size=64, max_input_len=2048, max_seq_len=4096,
                                                         max_num_tokens=4096, tokens_per_block=32))


def refusal(options=OPTIONS, quant_format="fp8", kv_cache_dtype="auto", gpu=H200, checkpoint_config=None) -> str:
    with pytest.raises(TrtllmPreflightError) as info:
        preflight(options, quant_format, kv_cache_dtype, gpu, checkpoint_config)
    return str(info.value)


def test_default_options_for_fp8_on_hopper_pass_without_warnings():
    assert preflight(OPTIONS, "fp8", "fp8", H200) == []


def test_turning_the_paged_kv_cache_off_is_refused_naming_inflight_batching():
    message = refusal(replace(OPTIONS, kv_cache_type="continuous"))
    assert "build.trtllm.kv_cache_type continuous cannot do in-flight batching" in message
    assert "TrtGptModelInflightBatching requires" in message
    assert "set kv_cache_type: paged" in message


@pytest.mark.parametrize(("change", "words"), [
    ({"remove_input_padding": False}, "packed input"),
    ({"gpt_attention_plugin": "disable"}, "GPT attention plugin"),
    ({"kv_cache_type": "disabled"}, "paged KV cache"),
])
def test_each_missing_inflight_batching_prerequisite_is_refused(change, words):
    message = refusal(replace(OPTIONS, **change))
    assert "cannot do in-flight batching" in message
    assert words in message


@pytest.mark.parametrize("change", [{"use_paged_context_fmha": False}, {"context_fmha": False}])
def test_settings_without_kv_block_reuse_are_refused(change):
    assert "reuse KV blocks" in refusal(replace(OPTIONS, **change))


def test_every_refusal_is_reported_at_once_one_line_each():
    message = refusal(replace(OPTIONS, kv_cache_type="continuous", remove_input_padding=False), gpu=A100)
    lines = message.splitlines()
    assert len(lines) == 3
    assert any("compute capability 8.9" in line and "8.0" in line for line in lines)


@pytest.mark.parametrize(("quant_format", "kv_cache_dtype"), [("fp8", "auto"), ("none", "fp8"), ("fp8", "fp8")])
def test_fp8_below_compute_capability_8_9_is_refused(quant_format, kv_cache_dtype):
    message = refusal(quant_format=quant_format, kv_cache_dtype=kv_cache_dtype, gpu=A100)
    assert "needs compute capability 8.9 or newer" in message
    assert "NVIDIA A100-SXM4-80GB is 8.0" in message


def test_fp8_on_ada_is_allowed_and_int4_on_ampere_too():
    assert preflight(OPTIONS, "fp8", "auto", {"gpu_name": "NVIDIA L40S", "compute_capability": "8.9"}) == []
    assert preflight(OPTIONS, "int4_awq", "auto", A100) == []


def test_without_a_gpu_the_gpu_checks_are_a_warning_not_a_refusal():
    for gpu in (None, {"gpu_name": None, "compute_capability": None}):
        warnings = preflight(OPTIONS, "fp8", "auto", gpu)
        assert len(warnings) == 1 and "no GPU is visible" in warnings[0] and "FP8 8.9 or newer" in warnings[0]
    assert "compute capability 8.0 or newer" in preflight(OPTIONS, "none", "auto", None)[0]


@pytest.mark.parametrize("quant_format", ["none", "int4_awq", "fp8"])
def test_every_format_below_compute_capability_8_0_is_refused_in_one_line(quant_format):
    message = refusal(quant_format=quant_format, gpu={"gpu_name": "Tesla T4", "compute_capability": "7.5"})
    assert message.splitlines() == [message]
    assert "needs compute capability 8.0 or newer" in message and "Tesla T4 is 7.5" in message


@pytest.mark.parametrize("capability", ["10.0", "10.3", "11.0"])
def test_int4_awq_on_compute_capability_10_and_11_is_refused_before_calibration(capability):
    message = refusal(quant_format="int4_awq", gpu={"gpu_name": "NVIDIA B200", "compute_capability": capability})
    assert "INT8/INT4 quantization is not supported on SM>=100." in message and "use format fp8" in message
    for allowed in ("9.0", "12.0"):
        assert preflight(OPTIONS, "int4_awq", "auto", {"gpu_name": "GPU", "compute_capability": allowed}) == []


def test_fp8_kv_cache_on_an_int4_checkpoint_is_refused_with_the_1_2_reason():
    message = refusal(quant_format="int4_awq", kv_cache_dtype="fp8")
    assert "FP8 Paged Context FMHA is disabled because FP8 context FMHA is disabled" in message
    assert "Chunked context requires context FMHA" in message  # what the executor then says at load


def test_int8_kv_cache_in_the_checkpoint_is_refused_with_paged_context_fmha():
    config = {"mapping": {"tp_size": 1, "pp_size": 1}, "quantization": {"kv_cache_quant_algo": "INT8"}}
    message = refusal(quant_format="none", checkpoint_config=config)
    assert "Paged Context FMHA is disabled because it doesn't work with int8 kv cache" in message


def test_a_checkpoint_written_for_another_tensor_parallel_size_is_refused():
    config = {"mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1}}
    message = refusal(checkpoint_config=config)
    assert "tp_size 2" in message and "build.tp_size is 1" in message


@pytest.mark.parametrize("quant_format", ["fp8", "int4_awq"])
def test_a_quantized_engine_over_several_gpus_is_refused_before_calibration(quant_format):
    options = replace(OPTIONS, tp_size=2)  # and no checkpoint yet: a dry run on a fresh cache
    message = refusal(options, quant_format)
    assert f"quantize.format {quant_format}" in message and "one GPU only" in message and "backend native" in message
    assert preflight(options, "none", "auto", H200) is not None  # an unquantized one converts at tp_size 2


def test_unknown_option_values_are_refused_naming_the_choices():
    message = refusal(replace(OPTIONS, kv_cache_type="pagged", gemm_plugin="int4"))
    assert "kv_cache_type 'pagged' is not one of paged, continuous, disabled" in message
    assert "gemm_plugin 'int4' is not one of" in message


def test_limits_that_work_but_surprise_are_warnings():
    options = replace(OPTIONS, plan=replace(OPTIONS.plan, max_num_tokens=1024), workers=4, gemm_plugin="fp8")
    config = {"mapping": {"tp_size": 1, "pp_size": 1}, "max_position_embeddings": 2048}
    warnings = preflight(options, "fp8", "auto", H200, config)
    assert [w.split(" ", 1)[0] for w in warnings] == ["build.max_seq_len", "build.max_num_tokens", "build.workers",
                                                      "build.trtllm.gemm_plugin"]
