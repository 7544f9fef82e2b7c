"""Build-time FP8 crossover: the choice from timings, its place in engine.json, the layers that follow it, and (on a
CUDA GPU, ``-m gpu``) the measurement a CUDA build makes."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.engines.native.tuning import CROSSOVER_TOKENS, linear_shapes, streaming_max_m
from kiln.runtime.errors import EngineFormatError
from kiln.runtime.native.engine_format import EngineConfig, QuantizationConfig
from kiln.runtime.native.layers.linear import FP8_STREAMING_MAX_M, Fp8Linear
from kiln.runtime.native.model.decoder import DecoderModel
from tests.model_factories import NEEDS_FP8_GPU


def test_streaming_serves_up_to_the_last_token_count_before_the_gemm_first_wins():
    assert streaming_max_m({1: (5, 9), 2: (6, 9), 4: (8, 9), 8: (10, 9), 16: (9, 10)}) == 4  # no second chance
    assert streaming_max_m({4: (1, 2), 1: (1, 2), 2: (1, 2)}) == 4  # in order of M, whatever the dict order
    assert streaming_max_m({1: (3, 2), 2: (1, 2)}) == 0  # the GEMM wins from the start: never stream
    assert streaming_max_m({1: (2, 2)}) == 0  # a tie goes to the GEMM


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA build measures")
def test_a_cpu_build_measures_nothing_and_the_layers_take_the_default(fp8_engine):
    config = EngineConfig.load(fp8_engine)
    assert config.quantization.fp8_streaming_max_m == {}
    model = DecoderModel.from_engine(fp8_engine, config, "cpu")
    assert model.layers[0].mlp.down_proj.streaming_max_m == FP8_STREAMING_MAX_M


def test_layers_follow_the_measured_limit_of_their_shape(fp8_engine, tmp_path):
    data = json.loads((fp8_engine / "engine.json").read_text())
    data["quantization"]["fp8_streaming_max_m"] = {QuantizationConfig.shape_key(128, 256): 3}  # qkv_proj's
    config = EngineConfig.from_dict(data)
    model = DecoderModel(config, torch.float32)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.qkv_proj, Fp8Linear) and attn.qkv_proj.streaming_max_m == 3
    assert attn.o_proj.streaming_max_m == FP8_STREAMING_MAX_M  # a shape not measured keeps the default
    assert mlp.gate_up_proj.streaming_max_m == FP8_STREAMING_MAX_M
    assert EngineConfig.from_dict(json.loads(config.to_json())) == config  # round trip through engine.json


@pytest.mark.parametrize("bad", [{"128x256": -1}, {"128x256": 2.5}, ["128x256"]])
def test_engine_json_with_a_bad_limit_is_refused(fp8_engine, bad):
    data = json.loads((fp8_engine / "engine.json").read_text())
    data["quantization"]["fp8_streaming_max_m"] = bad
    with pytest.raises(EngineFormatError, match="fp8_streaming_max_m"):
        EngineConfig.from_dict(data)


@pytest.mark.gpu
@NEEDS_FP8_GPU
def test_a_cuda_build_measures_every_linear_shape(fp8_engine):
    config = EngineConfig.load(fp8_engine)
    measured = config.quantization.fp8_streaming_max_m
    assert set(measured) == {QuantizationConfig.shape_key(k, n) for k, n in linear_shapes(config.architecture).values()}
    assert all(m in (0, *CROSSOVER_TOKENS) for m in measured.values())
    model = DecoderModel.from_engine(fp8_engine, config, "cuda")
    assert model.layers[0].mlp.down_proj.streaming_max_m == measured[QuantizationConfig.shape_key(256, 128)]
