"""Log probabilities, penalties and structured output on the GPU path (bfloat16, Triton kernels, CUDA graphs,
overlapped steps), against transformers on the same GPU."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
import torch

from kiln.engines.native.builder import build_native_engine
from kiln.runtime import LLM, SamplingParams
from tests.model_factories import make_hf_checkpoint, tiny_plan
from tests.test_server_support import TOKENIZER_SOURCE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 17, 33, 8, 90, 41, 12], [3, 64, 9]]
STEPS = 12
LOGPROB_ATOL = 0.1  # bfloat16 logits (relative error up to ~3e-2 of the largest) through log-softmax


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import shutil

    import tokenizers

    root = tmp_path_factory.mktemp("gpu-features")
    vocab = tokenizers.Tokenizer.from_file(str(TOKENIZER_SOURCE / "tokenizer.json")).get_vocab_size()
    checkpoint = make_hf_checkpoint(root / "hf", vocab_size=vocab, hidden_size=128, num_heads=4, num_kv_heads=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_SOURCE / name, checkpoint / name)
    (root / "engine").mkdir()
    build_native_engine(checkpoint, root / "engine", tiny_plan(max_seq_len=256, max_num_tokens=256), "bfloat16",
                        device="cuda")
    return root


@pytest.fixture(scope="module")
def llm(built):
    with LLM.load(built / "engine") as llm:
        yield llm


def test_logprobs_and_prompt_logprobs_match_transformers_in_bfloat16(built, llm):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(built / "hf", dtype=torch.bfloat16).cuda().eval()
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        ids = prompt + output.token_ids
        with torch.no_grad():
            reference = hf(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1)
        expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids) - 1)]
        got = [e.logprob for e in output.prompt_logprobs[1:]] + [e.logprob for e in output.logprobs[:-1]]
        assert got == pytest.approx(expected, abs=LOGPROB_ATOL)
        assert output.prompt_logprobs[0] is None


def test_structured_output_and_penalties_on_the_gpu_path(llm):
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tag": {"enum": ["a", "b", "c"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], free)[0].token_ids
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_output={"json": schema})
                   for s in range(6)]
    outputs = llm.generate(["Once upon a time"] + ["JSON:"] * 6, [free, *constrained])
    assert outputs[0].token_ids == alone  # the unconstrained request in the same batches is untouched
    for output in outputs[1:]:
        assert jsonschema_rs.validator_for(schema).is_valid(json.loads(output.text)), output.text
    penalized = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                  repetition_penalty=1.5, presence_penalty=1.0))
    assert penalized[0].token_ids != alone
