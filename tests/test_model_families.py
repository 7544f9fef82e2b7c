"""Every family the native engine runs against transformers on the same random weights: greedy tokens identical in
float32 on the CPU for a batch of prompts in flight together, through the runtime (LLM)."""

from __future__ import annotations

import pytest
import torch

from kiln.engines.native.builder import build_native_engine
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.native.engine_format import EngineConfig
from tests.model_factories import FAMILY_CLASSES, build_tiny_engine, hf_greedy, tiny_plan

PROMPTS = [[5, 17, 33, 8, 90, 41, 12], [3, 64, 9], [77, 21, 50, 50, 6, 31, 2, 88, 14, 19, 60, 7, 7, 40, 33, 12]]
WINDOW = 6  # shorter than the longest prompt, and than every prompt with its completion
STEPS = 12

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]}  # one per rotary pair of head_dim 16
# each family's quirks, over GQA and MHA, tied and untied embeddings
CASES = {
    "qwen2-gqa": dict(family="qwen2", num_heads=4, num_kv_heads=2),
    "qwen2-mha-tied": dict(family="qwen2", num_heads=2, num_kv_heads=2, tie_word_embeddings=True),
    "qwen3-gqa": dict(family="qwen3", num_heads=4, num_kv_heads=1, head_dim=32),
    "qwen3-mha-attention-bias": dict(family="qwen3", num_heads=2, num_kv_heads=2, attention_bias=True),
    "llama-attention-and-mlp-bias": dict(family="llama", num_heads=4, num_kv_heads=2, attention_bias=True,
                                         mlp_bias=True),
    # dynamic NTK (transformers rescales only past max_position_embeddings, which no plan may exceed)
    "llama-dynamic-ntk": dict(family="llama", num_heads=4, num_kv_heads=2,
                              rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    # transformers' Llama rotates every dimension whatever partial_rotary_factor says (Phi-3's applies it: refused)
    "llama-partial-rotary-factor-ignored": dict(family="llama", num_heads=4, num_kv_heads=2, partial_rotary_factor=0.5),
    "mistral-sliding-window": dict(family="mistral", num_heads=4, num_kv_heads=2, sliding_window=WINDOW),
    "qwen2-sliding-window-from-layer-1": dict(family="qwen2", num_heads=4, num_kv_heads=2, use_sliding_window=True,
                                              sliding_window=WINDOW, max_window_layers=1),
    "phi3-sliding-window": dict(family="phi3", num_heads=4, num_kv_heads=2, pad_token_id=0, sliding_window=WINDOW),
    # caps small enough to bind on random weights; a query scale other than head_dim's
    "gemma2-gqa-tied": dict(family="gemma2", num_heads=4, num_kv_heads=2, sliding_window=WINDOW,
                            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, query_pre_attn_scalar=24),
    "gemma2-mha-untied": dict(family="gemma2", num_heads=2, num_kv_heads=2, sliding_window=WINDOW,
                              tie_word_embeddings=False, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                              query_pre_attn_scalar=24),
    # LongRoPE (Phi-3 128k): prompts longer than the original context take the long factors throughout, a context
    # that never outgrows it the short ones, and one that outgrows it while it generates is recomputed with the long
    # ones (as transformers' Phi-3 recomputes its cache; the reference recomputes every step); all scaled by the
    # attention factor
    "phi3-longrope-crossing": dict(family="phi3", num_heads=4, num_kv_heads=2, pad_token_id=0,
                                   rope_scaling=dict(LONGROPE, original_max_position_embeddings=10),
                                   original_max_position_embeddings=10),
    "phi3-longrope-long": dict(family="phi3", num_heads=4, num_kv_heads=2, pad_token_id=0,
                               rope_scaling=dict(LONGROPE, original_max_position_embeddings=2),
                               original_max_position_embeddings=2),
    "phi3-longrope-short": dict(family="phi3", num_heads=4, num_kv_heads=2, pad_token_id=0,
                                rope_scaling=dict(LONGROPE, original_max_position_embeddings=64),
                                original_max_position_embeddings=64),
    # transformers' Phi3Config reads "yarn" (as "su") as LongRoPE
    "phi3-yarn-is-longrope": dict(family="phi3", num_heads=4, num_kv_heads=2, pad_token_id=0,
                                  rope_scaling=dict(LONGROPE, rope_type="yarn", original_max_position_embeddings=10),
                                  original_max_position_embeddings=10),
    # YaRN (Qwen2.5 / Qwen3 long context): factor 4 over an original context the prompts outgrow; its defaults
    # (attention factor from the factor), and mscale / mscale_all_dim with an untruncated range and other betas
    "qwen2-yarn": dict(family="qwen2", num_heads=4, num_kv_heads=2,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    "qwen3-yarn-mscale": dict(family="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256,
                              rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                                            "mscale": 0.9, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                                            "truncate": False}),
    "phi3-gqa": dict(family="phi3", num_heads=4, num_kv_heads=2, pad_token_id=0),
    "phi3-mha-tied": dict(family="phi3", num_heads=2, num_kv_heads=2, tie_word_embeddings=True, pad_token_id=0),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_greedy_tokens_match_transformers_for_a_batch_in_flight(tmp_path, case):
    check_greedy_tokens(tmp_path, case, "cpu")


# on the GPU in float32: the Triton kernels (windows and soft-capping included) and CUDA graphs, tokens still equal
GPU_CASES = ("qwen2-gqa", "qwen3-gqa", "mistral-sliding-window", "gemma2-gqa-tied", "phi3-gqa")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", GPU_CASES)
def test_greedy_tokens_match_transformers_on_the_gpu(tmp_path, name):
    check_greedy_tokens(tmp_path, CASES[name], "cuda")


def check_greedy_tokens(tmp_path, case: dict, device: str) -> None:
    """An engine of ``case``'s random checkpoint built for ``device`` gives transformers' greedy tokens (float32,
    eager attention on the CPU) for the prompts in flight together, and for the longest prompt alone first."""
    from transformers import AutoModelForCausalLM

    engine = build_tiny_engine(tmp_path, device=device, **case)
    checkpoint = tmp_path / "checkpoint"
    assert EngineConfig.load(engine).architecture.type == case["family"]
    # eager: transformers' SDPA path drops Gemma 2's attention soft-capping
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf).__name__ == FAMILY_CLASSES[case["family"]][1]
    expected, _ = hf_greedy(hf, PROMPTS, STEPS)
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    with LLM.load(engine) as llm:
        alone = llm.generate([PROMPTS[2]], greedy)[0]  # a prompt alone, first: attended in one piece (whole_prompt)
        outputs = llm.generate(PROMPTS, greedy)  # its prefix now cached: a chunk after cached blocks
    assert [output.token_ids for output in outputs] == expected
    assert alone.token_ids == expected[2]


def test_longrope_sequences_are_recomputed_in_an_engine_process_too(tmp_path):
    """``kiln serve``'s default: the requests are made in the server's process and added in the engine's."""
    from transformers import AutoModelForCausalLM

    from kiln.runtime.options import RuntimeOptions

    engine = build_tiny_engine(tmp_path, **CASES["phi3-longrope-crossing"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", dtype=torch.float32,
                                              attn_implementation="eager").eval()
    expected, _ = hf_greedy(hf, PROMPTS, STEPS)
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    with LLM.load(engine, RuntimeOptions(engine_process=True)) as llm:
        assert [output.token_ids for output in llm.generate(PROMPTS, greedy)] == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2", "phi3"])
@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
def test_quantized_builds_of_each_family_pass_their_gate_and_serve(tmp_path, family, fmt):
    from kiln.calibration.quantize import quantize_checkpoint
    from tests.calibration_factories import make_checkpoint, small_recipe

    checkpoint = make_checkpoint(tmp_path / "hf", family=family)
    report = quantize_checkpoint(checkpoint, small_recipe(format=fmt), tmp_path / "quantized")
    assert report["gate"]["passed"] and report["format"] == fmt
    # modelopt has no TensorRT-LLM export for Gemma 2 and Phi-3: the report says so and the native build needs none
    assert any("no TensorRT-LLM checkpoint" in note for note in report["notes"]) == (family in ("gemma2", "phi3"))
    engine = tmp_path / "engine"
    engine.mkdir()
    build_native_engine(tmp_path / "quantized" / "hf", engine, tiny_plan(), "float32")
    config = EngineConfig.load(engine)
    assert (config.architecture.type, config.quantization.format) == (family, fmt)
    with LLM.load(engine) as llm:
        assert len(llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_a_config_json_that_omits_a_family_setting_gets_transformers_default():
    from pathlib import Path

    from kiln.engines.native.checkpoint import parse_architecture

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 30, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 96, "max_position_embeddings": 256}
    gemma = parse_architecture({"architectures": ["Gemma2ForCausalLM"], **shape}, {}, Path("config.json"))
    assert (gemma.hidden_act, gemma.query_pre_attn_scalar, gemma.sliding_window) == ("gelu_pytorch_tanh", 256.0, 4096)
    assert gemma.tie_word_embeddings and gemma.layer_types[:2] == ["sliding_attention", "full_attention"]
    qwen = parse_architecture({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                               "sliding_window": 8, **shape}, {}, Path("config.json"))
    assert qwen.layer_types == ["full_attention"] * 28 + ["sliding_attention"] * 2  # from max_window_layers 28


@pytest.mark.parametrize(("family", "extra", "words"), [
    ("LlamaForCausalLM", {"hidden_act": "relu"}, "hidden_act 'relu' is not supported .*silu, gelu_pytorch_tanh"),
    # at the top level too: transformers moves it into the rope parameters, where the scaled types apply it
    ("LlamaForCausalLM", {"partial_rotary_factor": 0.5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "partial_rotary_factor 0.5 is not supported"),
    ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not supported"),
    (None, {"model_type": "gpt2"}, "architecture model_type 'gpt2' is not supported"),
    ("Phi3ForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope type 'linear' is not one this architecture takes .*default, longrope, su, yarn"),
    ("Qwen2ForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5 is not supported"),
])
def test_what_the_decoder_lacks_is_refused_by_name(family, extra, words):
    from pathlib import Path

    from kiln.engines.native.checkpoint import parse_architecture
    from kiln.runtime.errors import KilnError

    config = {"architectures": [family] if family else [], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 96,
              "max_position_embeddings": 256, **extra}
    with pytest.raises(KilnError, match=words):
        parse_architecture(config, {}, Path("config.json"))


def test_a_config_without_architectures_is_read_by_its_model_type_as_transformers_does():
    from pathlib import Path

    from kiln.engines.native.checkpoint import parse_architecture

    config = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96, "max_position_embeddings": 256}
    assert parse_architecture(config, {}, Path("config.json")).type == "qwen3"


def test_a_tied_checkpoint_holding_a_head_of_its_own_uses_that_head_as_transformers_5_does(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from kiln.engines.native.builder import build_native_engine
    from tests.model_factories import make_hf_checkpoint, tiny_plan

    checkpoint = make_hf_checkpoint(tmp_path / "checkpoint", 0, family="llama", tie_word_embeddings=True)
    engine = tmp_path / "engine"
    weights = load_file(checkpoint / "model.safetensors")
    head = torch.randn(weights["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(1))
    save_file({**weights, "lm_head.weight": 0.15 * head}, checkpoint / "model.safetensors", metadata={"format": "pt"})
    engine.mkdir()
    build_native_engine(checkpoint, engine, tiny_plan(), "float32")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    expected, _ = hf_greedy(hf, PROMPTS, STEPS)
    with LLM.load(engine) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    assert [output.token_ids for output in outputs] == expected
    assert not EngineConfig.load(engine).architecture.tie_word_embeddings


def test_gemma2_in_float16_is_refused_before_any_stage_as_vllm_refuses_it(tmp_path):
    from kiln.engines.native.builder import preflight_native_plan
    from kiln.runtime.plan import PlanError
    from tests.calibration_factories import make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "hf", family="gemma2", hidden=64, intermediate=128)
    with pytest.raises(PlanError, match="model.dtype float16 cannot run gemma2: its activations overflow float16"):
        preflight_native_plan(checkpoint, tiny_plan(), "float16")
    preflight_native_plan(checkpoint, tiny_plan(), "bfloat16")
