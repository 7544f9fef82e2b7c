"""Checkpoints Kiln did not quantize itself: another tool's quantization, an already quantized checkpoint given to
the quantize stage, and a W4A16_AWQ export whose group size is wrong are refused in one line naming the problem."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.calibration.checkpoint_checks import check_quantizable
from kiln.calibration.errors import CalibrationError
from kiln.engines.native.checkpoint import read_quantization
from kiln.engines.native.weights import _fuse_int4
from kiln.runtime.errors import KilnError


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors"])
def test_another_tools_quantization_is_refused_naming_its_method(tmp_path, method):
    cfg = {"quantization_config": {"quant_method": method, "bits": 4, "group_size": 128}}
    with pytest.raises(KilnError, match=f"quant_method '{method}' is not supported by the native backend"):
        read_quantization(tmp_path, cfg)


@pytest.mark.parametrize("group_size", [0, None, "128", True])
def test_a_w4a16_awq_group_size_that_is_not_a_positive_integer_is_refused(tmp_path, group_size):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "W4A16_AWQ", "group_size": group_size}}))
    with pytest.raises(KilnError, match=f"group_size {group_size!r} must be a positive integer"):
        read_quantization(tmp_path, {})


def test_a_group_size_that_does_not_divide_a_linears_input_features_is_named_as_such():
    class Tensors(dict):
        def get(self, name):
            return self[name]

    packed = torch.zeros(4, 256, dtype=torch.uint8)  # 8 outputs x 256 inputs
    tensors = Tensors({"proj.weight": packed, "proj.weight_scale": torch.ones(8, 2)})
    with pytest.raises(KilnError, match="proj has 256 input features, not a multiple of .* group_size 96"):
        _fuse_int4(tensors, ["proj"], "fused", 96)


@pytest.mark.parametrize("declared", [
    {"hf_quant_config.json": {"quantization": {"quant_algo": "W4A16_AWQ", "group_size": 128}}},
    {"config.json": {"quantization_config": {"quant_method": "awq", "bits": 4}}},
])
def test_the_quantize_stage_refuses_a_checkpoint_that_is_already_quantized(tmp_path, declared):
    config = {"architectures": ["LlamaForCausalLM"], **declared.get("config.json", {})}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    if "hf_quant_config.json" in declared:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(declared["hf_quant_config.json"]))
    with pytest.raises(CalibrationError, match="the checkpoint is already quantized .*quantize.format: none"):
        check_quantizable(tmp_path)


@pytest.mark.parametrize(("files", "described"), [
    ({"hf_quant_config.json": {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}}, ("fp8", "fp8")),
    ({"hf_quant_config.json": {"quantization": {"quant_algo": "W4A16_AWQ"}}}, ("int4_awq", "auto")),
    ({}, ("none", "auto")),
    ({"config.json": {"quantization_config": {"quant_method": "gptq"}}}, ("none", "auto")),  # the build refuses it
])
def test_an_engine_built_as_its_checkpoint_is_described_by_the_quantization_the_checkpoint_declares(
        tmp_path, files, described):
    from types import SimpleNamespace

    from kiln.pipeline.config import KilnConfig
    from kiln.pipeline.stages import _described_quantization

    (tmp_path / "config.json").write_text(json.dumps(files.get("config.json", {"architectures": ["Llama"]})))
    if "hf_quant_config.json" in files:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(files["hf_quant_config.json"]))
    config = KilnConfig.model_validate({"model": {"path": str(tmp_path)}})  # format none: built as it is
    assert _described_quantization(SimpleNamespace(config=config, calibration=None, checkpoint_dir=tmp_path)) \
        == described
    quantized = KilnConfig.model_validate({"model": {"path": "m"}, "quantize": {"format": "fp8"}})
    assert _described_quantization(SimpleNamespace(config=quantized, calibration={"format": "fp8"},
                                                   checkpoint_dir=tmp_path)) == ("fp8", "auto")
