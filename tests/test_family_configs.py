"""A family's config.json means to the native builder what it means to transformers: fields left out take the
defaults of the family's config class, and fields its transformers model does not read change nothing. Parsing
only (no weights), against transformers' own config classes."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import transformers

from kiln.engines.native.checkpoint import parse_architecture, read_architecture
from kiln.runtime.errors import KilnError
from kiln.runtime.native.engine_format import Architecture
from tests.model_factories import FAMILY_CLASSES

ARCHITECTURES = {family: classes[1] for family, classes in FAMILY_CLASSES.items()}
MINIMAL = {"vocab_size": 96, "hidden_size": 512, "intermediate_size": 256, "num_hidden_layers": 3,
           "num_attention_heads": 32}
PATH = Path("config.json")


def parse(family: str, **fields) -> Architecture:
    return parse_architecture({"architectures": [ARCHITECTURES[family]], **MINIMAL, **fields}, {}, PATH)


def transformers_config(family: str, **fields) -> transformers.PretrainedConfig:
    return getattr(transformers, FAMILY_CLASSES[family][0])(**{**MINIMAL, **fields})


def transformers_windows(family: str, config: transformers.PretrainedConfig) -> list[int | None]:
    """The positions each layer of transformers' model attends to: Llama never slides, Mistral and Phi-3 slide on
    every layer when they have a window, the others on the layers their ``layer_types`` mark."""
    window = getattr(config, "sliding_window", None)
    if family == "llama" or window is None:
        return [None] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) if family != "phi3" else None  # Phi-3's model never reads them
    types = types or ["sliding_attention"] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in types]


@pytest.mark.parametrize("family", sorted(FAMILY_CLASSES))
@pytest.mark.parametrize("fields", [{}, {"use_sliding_window": True}], ids=["minimal", "sliding-turned-on"])
def test_fields_left_out_take_the_transformers_defaults_of_the_family(family, fields):
    arch, config = parse(family, **fields), transformers_config(family, **fields)
    activation = config.hidden_activation if family == "gemma2" else config.hidden_act
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert (arch.num_kv_heads, arch.head_dim, arch.rms_norm_eps, arch.hidden_act, arch.tie_word_embeddings,
            arch.max_position_embeddings) == (config.num_key_value_heads, head_dim, config.rms_norm_eps, activation,
                                              config.tie_word_embeddings, config.max_position_embeddings)
    assert [arch.layer_window(i) for i in range(arch.num_layers)] == transformers_windows(family, config)


@pytest.mark.parametrize(("family", "fields"), [
    ("llama", {"sliding_window": 8}),
    ("mistral", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"hidden_activation": "gelu_pytorch_tanh"}),
    ("qwen2", {"hidden_activation": "gelu_pytorch_tanh"}),
    ("gemma2", {"hidden_act": "silu"}),
])
def test_fields_the_family_does_not_read_change_nothing(family, fields):
    assert parse(family, **fields) == parse(family)


def test_gemma2_reads_its_activation_from_hidden_activation_and_refuses_one_it_cannot_run():
    assert parse("gemma2", hidden_activation="gelu_pytorch_tanh", hidden_act="relu").hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(KilnError, match="hidden_activation 'relu' is not supported"):
        parse("gemma2", hidden_activation="relu", hidden_act="gelu_pytorch_tanh")


def test_an_unsupported_hidden_act_is_refused_even_beside_a_supported_hidden_activation():
    with pytest.raises(KilnError, match="hidden_act 'relu' is not supported"):
        parse("llama", hidden_act="relu", hidden_activation="gelu_pytorch_tanh")


def test_mistral_without_a_window_and_gemma2_with_attention_biases():
    assert parse("mistral", sliding_window=None).sliding_window is None
    arch = parse("gemma2", attention_bias=True)
    assert (arch.qkv_bias, arch.o_bias) == (True, True)


@pytest.mark.parametrize(("family", "rope", "in_parameters", "top_level", "expected"), [
    ("phi3", "longrope", 32, 64, 64),  # a field of Phi-3's config class, ahead of the rope parameters'
    ("phi3", "longrope", 32, None, 4096),  # its default
    # not a field of Llama's, but config.json's top-level one still wins once the model computes its rotary
    # frequencies (standardize_rope_params in the rope init: hasattr(config, ...))
    ("llama", "llama3", 32, 64, 64),
    ("llama", "longrope", None, 64, 64),
    ("llama", "llama3", None, 64, 64),
    ("llama", "llama3", None, None, 8192),  # else max_position_embeddings
])
def test_the_original_context_of_rope_scaling_is_read_as_transformers_reads_it(family, rope, in_parameters,
                                                                               top_level, expected):
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8} if rope == "longrope" else {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling = {"rope_type": rope, **factors,
               **({"original_max_position_embeddings": in_parameters} if in_parameters else {})}
    fields = {"max_position_embeddings": 8192, "rope_scaling": scaling,
              **({"original_max_position_embeddings": top_level} if top_level else {})}
    assert parse(family, **fields).rope_scaling["original_max_position_embeddings"] == expected
    config = getattr(transformers, FAMILY_CLASSES[family][0]).from_dict(copy.deepcopy({**MINIMAL, **fields}))
    config.standardize_rope_params()  # what the model's rotary embedding runs before it reads the parameters
    assert config.rope_parameters["original_max_position_embeddings"] == expected


def test_rope_scaling_beside_rope_parameters_wins_as_in_transformers():
    fields = {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0},
              "rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 30000.0}
    arch = parse("qwen2", **fields)
    config = transformers.Qwen2Config.from_dict(copy.deepcopy({**MINIMAL, **fields}))
    assert (arch.rope_theta, arch.rope_scaling["rope_type"], arch.rope_scaling["factor"]) == (
        config.rope_parameters["rope_theta"], config.rope_parameters["rope_type"], config.rope_parameters["factor"])
    with pytest.raises(KilnError, match="'ntk-by-parts' is not supported"):  # refused wherever it is written
        parse("qwen2", rope_parameters={"rope_type": "default"}, rope_scaling={"type": "ntk-by-parts", "factor": 4.0})


def test_phi3_slides_every_layer_whatever_layer_types_says():
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    arch = parse("phi3", sliding_window=8, layer_types=types)
    config = transformers.Phi3Config(**MINIMAL, sliding_window=8, layer_types=types)
    assert [arch.layer_window(i) for i in range(3)] == transformers_windows("phi3", config) == [8, 8, 8]


@pytest.mark.parametrize("types", [["sliding_attention"] * 2,  # three layers
                                   ["sliding_window", "full_attention", "full_attention"]])  # a misspelt type
def test_layer_types_that_transformers_refuses_are_refused_naming_them(types):
    with pytest.raises(Exception, match="layer_types"):  # noqa: B017 - huggingface_hub's validation error
        transformers.Qwen2Config(**MINIMAL, use_sliding_window=True, sliding_window=8, layer_types=types)
    with pytest.raises(KilnError, match=f"layer_types .*{types[0]}.* each of the 3 layers"):
        parse("qwen2", use_sliding_window=True, sliding_window=8, layer_types=types)


def test_an_attention_type_the_engine_does_not_run_is_refused_not_read_as_full_attention():
    types = ["chunked_attention", "full_attention", "full_attention"]  # transformers' Qwen2 model fails on it
    with pytest.raises(KilnError, match="chunked_attention"):
        parse("qwen2", use_sliding_window=True, sliding_window=8, layer_types=types)


@pytest.mark.parametrize(("alias", "canonical"), [("swish", "silu"), ("gelu_new", "gelu_pytorch_tanh")])
def test_transformers_other_names_of_a_supported_activation_are_read_as_it(alias, canonical):
    import torch
    from transformers.activations import ACT2FN

    x = torch.linspace(-6, 6, 101)
    torch.testing.assert_close(ACT2FN[alias](x), ACT2FN[canonical](x))  # the same function in transformers
    assert parse("llama", hidden_act=alias).hidden_act == canonical


@pytest.mark.parametrize(("scaling", "message"), [
    ({"type": "linear", "factor": 0.0}, "rope_scaling factor 0.0 must be positive"),
    ({"type": "linear", "factor": -2.0}, "rope_scaling factor -2.0 must be positive"),
    ({"type": "linear", "factor": "2.0"}, "rope_scaling factor must be a number, got '2.0'"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1, "beta_slow": 8}, "beta_fast 1 must be at least beta_slow"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0},
     "high_freq_factor 2.0 must be above low_freq_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [0.0] * 8}, "not finite"),
])
def test_rope_scaling_values_that_give_no_finite_frequencies_are_refused_naming_them(scaling, message):
    with pytest.raises(KilnError, match=message):
        parse("llama", head_dim=16, rope_scaling=scaling)


@pytest.mark.parametrize(("family", "fields", "message"), [
    ("llama", {"head_dim": "16"}, "head_dim must be a positive integer, got '16'"),
    ("llama", {"head_dim": 15}, "head_dim 15 is odd"),
    ("llama", {"num_key_value_heads": "2"}, "num_key_value_heads must be a positive integer, got '2'"),
    ("llama", {"rope_theta": "x"}, "rope_theta must be a positive number, got 'x'"),
    ("llama", {"rms_norm_eps": None}, "rms_norm_eps must be a positive number, got None"),
    ("llama", {"rope_scaling": "linear"}, "rope_scaling must be an object"),
    ("mistral", {"sliding_window": -5}, "sliding_window must be a positive integer or null"),
    ("mistral", {"sliding_window": "8"}, "sliding_window must be a positive integer or null"),
    ("mistral", {"sliding_window": 0}, "sliding_window must be a positive integer or null"),  # transformers fails
    ("gemma2", {"attn_logit_softcapping": "3.0"}, r"attn_logit_softcapping \(null: no cap\) must be a positive number"),
    ("gemma2", {"final_logit_softcapping": 0}, r"final_logit_softcapping \(null: no cap\) must be a positive number"),
    ("gemma2", {"attn_logit_softcapping": True}, "attn_logit_softcapping"),
    ("gemma2", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number, got 0"),
    ("llama", {"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ("llama", {"attention_bias": "false"}, "attention_bias must be true or false"),  # not truthy: transformers too
    ("qwen2", {"use_sliding_window": "false", "sliding_window": 4}, "use_sliding_window must be true or false"),
    ("llama", {"rope_scaling": {"type": "yarn"}}, "rope scaling 'yarn' needs key 'factor'"),
    ("qwen2", {"rope_scaling": {"type": "dynamic"}}, "rope scaling 'dynamic' needs key 'factor'"),
])
def test_config_fields_of_the_wrong_type_or_value_are_refused_naming_them(family, fields, message):
    with pytest.raises(KilnError, match=message):
        parse(family, **fields)


@pytest.mark.parametrize("family", ["gemma2", "qwen2"])
def test_rope_parameters_per_layer_type_are_refused_not_dropped(family):
    per_type = {kind: {"rope_type": "default", "rope_theta": 1e6} for kind in ("full_attention", "sliding_attention")}
    with pytest.raises(KilnError, match="rope_parameters per layer type .* not supported"):
        parse(family, rope_parameters=per_type)


def test_a_config_value_no_check_names_is_refused_as_one_line_naming_config_json(tmp_path):
    scaling = {"rope_type": "longrope", "short_factor": ["a"] * 8, "long_factor": [1.0] * 8}
    config = {"architectures": [ARCHITECTURES["llama"]], **MINIMAL, "head_dim": 16, "rope_scaling": scaling}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KilnError, match=r"config.json: a field has the wrong type or value \(.*\); fix config.json"):
        read_architecture(tmp_path)


@pytest.mark.parametrize(("fields", "problem"), [
    ({"hidden_size": 2**40, "intermediate_size": 2**42},
     "vocab_size 96, hidden_size 1099511627776 make embed_tokens a tensor of 1.06e+14 elements"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers 1000000000 is more than 10,000: no model has that many"),
])
def test_sizes_no_model_has_are_refused_naming_config_json_and_the_field(fields, problem):
    with pytest.raises(KilnError, match=f"^config.json: {re.escape(problem)}.*; fix config.json$"):
        parse("llama", **fields)


@pytest.mark.parametrize(("key", "value"), [("torch_dtype", "banana"), ("torch_dtype", 5), ("dtype", "banana"),
                                            ("dtype", "auto")])
def test_a_dtype_that_names_no_torch_dtype_is_refused_naming_the_field(key, value):
    with pytest.raises(KilnError, match=f"^config.json: {key} {re.escape(repr(value))} is not the name of a torch"):
        parse("llama", **{key: value})


def test_the_dtype_names_transformers_writes_are_taken():
    for name in ("float32", "float16", "bfloat16", None):
        assert parse("llama", dtype=name, torch_dtype=name).vocab_size == MINIMAL["vocab_size"]


@pytest.mark.parametrize(("config", "generation", "source"), [
    ({}, {"eos_token_id": [99999, -3]}, "generation_config.json"),
    ({"eos_token_id": -3}, {}, "config.json"),
    ({"eos_token_id": 2}, {"eos_token_id": [2, "2"]}, "generation_config.json"),
])
def test_an_eos_token_id_outside_the_vocabulary_is_refused_naming_its_file(config, generation, source):
    with pytest.raises(KilnError, match=rf"^{source}: eos_token_id .* not a token id of the vocabulary \(0 to 95\); "
                                        rf"fix {source}$"):
        parse_architecture({"architectures": [ARCHITECTURES["llama"]], **MINIMAL, **config}, generation, PATH)
