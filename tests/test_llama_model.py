"""DecoderModel (native engine, paged KV) against transformers' LlamaForCausalLM on the same random weights."""

from __future__ import annotations

import pytest
import torch

from kiln.engines.native.builder import build_native_engine
from kiln.runtime.native.engine_format import EngineConfig
from kiln.runtime.native.model.decoder import DecoderModel
from tests.model_factories import LLAMA3_ROPE, PagedRunner, hf_greedy, make_hf_checkpoint, tiny_plan

PROMPTS = [[5, 17, 33, 8, 90, 41, 12], [3, 64, 9], [77, 21, 50, 50, 6, 31, 2, 88, 14, 19, 60]]
STEPS = 16
REL_TOL = 1e-4  # max |logit difference| relative to the largest |logit|, float32 on CPU

SHAPES = {
    "mha-head_dim32": dict(hidden_size=64, num_heads=2, num_kv_heads=2),
    "gqa2-head_dim16": dict(hidden_size=64, num_heads=4, num_kv_heads=2),
    "gqa4-head_dim64": dict(hidden_size=128, num_heads=4, num_kv_heads=1, head_dim=64),
    "tied-embeddings": dict(hidden_size=64, num_heads=2, num_kv_heads=1, tie_word_embeddings=True),
    "llama3-rope-scaling": dict(hidden_size=64, num_heads=2, num_kv_heads=1, rope_scaling=LLAMA3_ROPE,
                                rope_theta=500000.0),
}


def build_engine(tmp_path, **config_kwargs):
    checkpoint = make_hf_checkpoint(tmp_path / "hf", **config_kwargs)
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    build_native_engine(checkpoint, engine_dir, tiny_plan(), "float32")
    config = EngineConfig.load(engine_dir)
    return checkpoint, DecoderModel.from_engine(engine_dir, config, "cpu", torch.float32), config


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_greedy_tokens_and_logits_match_transformers(tmp_path, shape):
    from transformers import LlamaForCausalLM

    checkpoint, model, config = build_engine(tmp_path, **shape)
    hf = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    tokens, logits = PagedRunner(model, config, len(PROMPTS)).greedy(PROMPTS, STEPS)
    hf_tokens, hf_logits = hf_greedy(hf, PROMPTS, STEPS)

    assert tokens == hf_tokens
    for step, (ours, ref) in enumerate(zip(logits, hf_logits, strict=True)):
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel <= REL_TOL, f"step {step}: relative logit difference {rel:.2e}"


def test_tied_engine_stores_no_lm_head(tmp_path):
    _, model, config = build_engine(tmp_path, tie_word_embeddings=True)
    assert config.architecture.tie_word_embeddings
    assert model.lm_head is None


def test_chunked_prefill_matches_single_prefill(tmp_path):
    _, model, config = build_engine(tmp_path)
    prompt = PROMPTS[2]
    whole = PagedRunner(model, config, 1).step([prompt], [len(prompt)])
    chunked = PagedRunner(model, config, 1)
    chunked.step([prompt[:4]], [4])
    chunked.step([prompt[4:9]], [9])
    last = chunked.step([prompt[9:]], [len(prompt)])
    torch.testing.assert_close(last, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bfloat16_engine_on_gpu_matches_transformers_on_gpu(tmp_path):
    from transformers import LlamaForCausalLM

    checkpoint = make_hf_checkpoint(tmp_path / "hf", hidden_size=128, num_heads=4, num_kv_heads=2)
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    build_native_engine(checkpoint, engine_dir, tiny_plan(), "bfloat16", device="cuda")
    config = EngineConfig.load(engine_dir)
    model = DecoderModel.from_engine(engine_dir, config, "cuda")
    hf = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()

    logits = PagedRunner(model, config, len(PROMPTS), "cuda").all_logits(PROMPTS)
    for prompt, ours in zip(PROMPTS, logits, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel <= 3e-2, f"bfloat16 relative logit difference {rel:.2e}"
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
