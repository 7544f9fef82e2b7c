"""engine.json values of the wrong type or outside what the runtime runs are refused when the engine is read, naming
the field and the value: before, they loaded and ran another model, raised a TypeError deep in a layer, or killed the
engine thread at its first request."""

from __future__ import annotations

import copy
import json
import re
import reprlib
from dataclasses import fields
from typing import Any

import pytest

from kiln.runtime.errors import EngineFormatError
from kiln.runtime.native.engine_format import (
    FIELD_RULES,
    ROPE_SCALING_RULES,
    SIZE_FIELDS,
    Architecture,
    EngineConfig,
    QuantizationConfig,
)
from kiln.runtime.native.layers.rotary import ROPE_TYPES
from tests.test_server_support import tiny_engine

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.1, "beta_fast": 32, "beta_slow": 1, "truncate": True,
        "original_max_position_embeddings": 64, "mscale": None}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2] * 8, "factor": 4.0,
            "attention_factor": 1.2, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def engine() -> dict[str, Any]:
    """The engine.json of the tiny Llama engine (vocab 1024, 2 layers, hidden 64, head_dim 16, intermediate 128)."""
    return json.loads((tiny_engine() / "engine.json").read_text())


def edited(engine: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``engine`` with each dotted path of ``changes`` set to its value."""
    data = copy.deepcopy(engine)
    for path, value in changes.items():
        *sections, key = path.split(".")
        target = data
        for section in sections:
            target = target[section]
        target[key] = value
    return data


BAD_VALUES = [  # (changes to the engine.json, words of the refusal)
    ({"architecture.hidden_act": "relu"}, "architecture.hidden_act must be one of silu, gelu_pytorch_tanh, got 'relu'"),
    ({"architecture.hidden_act": "swish"}, "hidden_act must be one of silu, gelu_pytorch_tanh, got 'swish'"),
    ({"architecture.hidden_act": 0}, "hidden_act must be one of silu, gelu_pytorch_tanh, got 0"),
    ({"architecture.rms_norm_eps": -1}, "architecture.rms_norm_eps must be a finite number above 0, got -1"),
    ({"architecture.rms_norm_eps": "x"}, "rms_norm_eps must be a finite number above 0, got 'x'"),
    ({"architecture.rms_norm_eps": None}, "rms_norm_eps must be a finite number above 0, got None"),
    ({"architecture.rms_norm_eps": True}, "rms_norm_eps must be a finite number above 0, got True"),
    ({"architecture.rope_theta": 0}, "architecture.rope_theta must be a finite number above 0, got 0"),
    ({"architecture.rope_theta": "10000"}, "rope_theta must be a finite number above 0, got '10000'"),
    ({"architecture.rope_theta": None}, "rope_theta must be a finite number above 0, got None"),
    ({"architecture.rope_theta": float("inf")}, "rope_theta must be a finite number above 0, got inf"),
    ({"architecture.rope_theta": 1e-50}, "rope_theta 1e-50 with rope type 'default' gives rotary frequencies that "
                                         "are not finite"),
    ({"architecture.rope_scaling": "linear"}, "architecture.rope_scaling must be null or an object, got 'linear'"),
    ({"architecture.rope_scaling": 2.0}, "rope_scaling must be null or an object, got 2.0"),
    ({"architecture.rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type must be one of default, linear, llama3, longrope, yarn, got 'dynamic'"),
    ({"architecture.rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type must be one of"),
    ({"architecture.rope_scaling": {"rope_type": "linear"}},
     "rope_scaling.factor must be a finite number above 0 for rope type 'linear', got None"),
    ({"architecture.rope_scaling": {**LLAMA3, "original_max_position_embeddings": 0}},
     "rope_scaling.original_max_position_embeddings must be a positive integer for rope type 'llama3', got 0"),
    ({"architecture.rope_scaling": {**YARN, "truncate": "yes"}}, "rope_scaling.truncate must be true or false"),
    ({"architecture.rope_scaling": {**YARN, "beta_fast": 0}}, "rope_scaling.beta_fast must be a finite number above"),
    ({"architecture.rope_scaling": {**LONGROPE, "short_factor": [1.0] * 7}}, "need head_dim / 2 = 8 values each"),
    ({"architecture.rope_scaling": {**LONGROPE, "long_factor": ["2"] * 8}},
     "rope_scaling.long_factor must be a list, each a finite number"),
    ({"architecture.query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be null or a finite number above 0, got 0"),
    ({"architecture.attn_logit_softcapping": "x"}, "attn_logit_softcapping must be null or a finite number above 0"),
    ({"architecture.attn_logit_softcapping": []}, "attn_logit_softcapping must be null or a finite number above 0"),
    ({"architecture.final_logit_softcapping": -30}, "final_logit_softcapping must be null or a finite number above"),
    ({"architecture.sliding_window": 0}, "architecture.sliding_window must be null or a positive integer, got 0"),
    ({"architecture.sliding_window": True}, "sliding_window must be null or a positive integer, got True"),
    ({"architecture.layer_types": []}, "layer_types must be null or a list of num_layers (2) layer types, got []"),
    ({"architecture.layer_types": {}}, "layer_types must be null or a list, each one of full_attention, "
                                       "sliding_attention, got {}"),
    ({"architecture.layer_types": ["full_attention", "local"]}, "layer_types must be null or a list, each one of"),
    ({"architecture.layer_types": ["sliding_attention", "full_attention"]},
     "sliding_window must be a positive integer where layer_types has sliding_attention layers, got None"),
    ({"architecture.eos_token_ids": 2}, "architecture.eos_token_ids must be a list, each an integer not below 0, "
                                        "got 2"),
    ({"architecture.eos_token_ids": [2, -1]}, "eos_token_ids must be a list, each an integer not below 0"),
    ({"architecture.eos_token_ids": [True]}, "eos_token_ids must be a list, each an integer not below 0"),
    ({"architecture.bos_token_id": 1024}, "bos_token_id must be null or below vocab_size (1024), got 1024"),
    ({"architecture.bos_token_id": "1"}, "bos_token_id must be null or an integer not below 0, got '1'"),
    ({"architecture.max_position_embeddings": 256.0}, "max_position_embeddings must be a positive integer, got 256.0"),
    ({"architecture.tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"architecture.qkv_bias": 1}, "architecture.qkv_bias must be true or false, got 1"),
    ({"architecture.qk_norm": None}, "qk_norm must be true or false, got None"),
    ({"architecture.sandwich_norms": "yes"}, "sandwich_norms must be true or false"),
    ({"architecture.type": "gpt2"}, "architecture.type must be one of llama"),
    ({"architecture.head_dim": 15}, "architecture.head_dim must be even"),
    ({"architecture.num_kv_heads": 3}, "architecture.num_heads must be a multiple of num_kv_heads (3), got 4"),
    ({"quantization.format": "int4_awq"}, "quantization.group_size must be a positive integer for format int4_awq, "
                                          "got None"),
    ({"quantization.format": "int4_awq", "quantization.group_size": 48},
     "group_size must be a divisor of the input features of every INT4 linear (self_attn.qkv_proj 64"),
    ({"quantization.group_size": True}, "quantization.group_size must be null or a positive integer, got True"),
    ({"quantization.kv_cache_dtype": None}, "quantization.kv_cache_dtype must be a string, got None"),
    ({"quantization.exclude_modules": None}, "quantization.exclude_modules must be a list, each a string, got None"),
    ({"quantization.exclude_modules": "lm_head"}, "exclude_modules must be a list, each a string, got 'lm_head'"),
    ({"quantization.fp8_streaming_max_m": {"64x128": True}}, "fp8_streaming_max_m must be an object of integers"),
    ({"dtype": ["float32"]}, "dtype must be one of bfloat16, float16, float32, got ['float32']"),
    ({"parallel.tp_size": 0}, "parallel.tp_size must be a positive integer, got 0"),
]


@pytest.mark.parametrize(("changes", "words"), BAD_VALUES, ids=[
    ",".join(f"{path.rsplit('.', 1)[-1]}={reprlib.repr(value)}" for path, value in changes.items())
    for changes, _ in BAD_VALUES])
def test_a_bad_value_is_refused_naming_the_field_and_the_value(engine, changes, words):
    with pytest.raises(EngineFormatError, match=re.escape(words)):
        EngineConfig.from_dict(edited(engine, changes))


@pytest.mark.parametrize("changes", [
    {"architecture.hidden_act": "gelu_pytorch_tanh", "architecture.query_pre_attn_scalar": 256,
     "architecture.attn_logit_softcapping": 50.0, "architecture.final_logit_softcapping": 30,
     "architecture.sliding_window": 4096, "architecture.layer_types": ["sliding_attention", "full_attention"]},
    {"architecture.rope_scaling": LLAMA3}, {"architecture.rope_scaling": YARN},
    {"architecture.rope_scaling": LONGROPE}, {"architecture.rope_scaling": {"rope_type": "linear", "factor": 2}},
    {"quantization.format": "int4_awq", "quantization.group_size": 32},
    {"quantization.format": "int4_awq", "quantization.group_size": 48,  # its linears all kept dense
     "quantization.exclude_modules": ["layers.*.self_attn.*", "layers.*.mlp.*"]},
    {"architecture.eos_token_ids": [2, 5000]},  # a tokenizer's added EOS past the model's vocabulary
    {"architecture.rms_norm_eps": 1, "architecture.bos_token_id": None},
])
def test_the_values_builders_write_are_taken(engine, changes):
    EngineConfig.from_dict(edited(engine, changes))


def test_every_field_and_rope_type_has_a_rule():
    sections = {"architecture": Architecture, "quantization": QuantizationConfig}
    named = {f"{section}.{f.name}" for section, cls in sections.items() for f in fields(cls)}
    assert named - {f"architecture.{name}" for name in SIZE_FIELDS} <= set(FIELD_RULES)
    assert tuple(ROPE_SCALING_RULES) == ROPE_TYPES
