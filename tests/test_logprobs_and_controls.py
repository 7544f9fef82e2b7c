"""Log probabilities and logit controls (penalties, logit bias, min_tokens) of the native engine, against
transformers' model and logits processors on the same random weights (float32 on CPU)."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from kiln.engines.native.builder import build_native_engine
from kiln.runtime import LLM, RuntimeOptions, SamplingParams
from kiln.runtime.engine_process import ProcessEngine
from tests.model_factories import build_tiny_engine, tiny_plan

PROMPTS = [[5, 17, 33, 8, 61, 12], [3, 64, 9, 3]]
STEPS = 12
ATOL = 1e-4  # log probabilities, float32 on CPU

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("controls")
    build_tiny_engine(root, seed=3)
    return root


@pytest.fixture(scope="module")
def llm(built):
    with LLM.load(built / "engine") as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(built):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(built / "checkpoint", dtype=torch.float32).eval()


def hf_log_probs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ``ids``: row i is the distribution of token i+1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def hf_greedy(hf, prompt: list[int], steps: int, processors) -> list[int]:
    """Greedy decoding with transformers' logits processors (``processors(input_ids, scores)``)."""
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            scores = hf(torch.tensor([ids])).logits[:, -1].float()
        ids.append(int(processors(torch.tensor([ids]), scores).argmax()))
    return ids[len(prompt):]


def greedy(llm: LLM, prompt: list[int], **params) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **params)
    return llm.generate([prompt], params)[0].token_ids


def test_completion_logprobs_are_transformers_log_softmax(llm, hf):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        reference = hf_log_probs(hf, prompt + output.token_ids)[len(prompt) - 1:-1]
        assert [lp.token_id for lp in output.logprobs] == output.token_ids
        for step, (lp, row) in enumerate(zip(output.logprobs, reference, strict=True)):
            assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=ATOL), step
            values, ids = row.topk(5)
            assert [t for t, _ in lp.top] == ids.tolist()
            assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=ATOL)


def test_logprobs_of_sampled_tokens_are_the_models_whatever_the_temperature(llm, hf):
    params = SamplingParams(temperature=1.7, seed=11, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    output = llm.generate([PROMPTS[0]], params)[0]
    reference = hf_log_probs(hf, PROMPTS[0] + output.token_ids)[len(PROMPTS[0]) - 1:-1]
    assert all(lp.top == [] for lp in output.logprobs)
    got = [lp.logprob for lp in output.logprobs]
    assert got == pytest.approx([row[t].item() for row, t in zip(reference, output.token_ids, strict=True)], abs=ATOL)
    for lp, row in zip(output.logprobs, reference, strict=True):
        assert_rank_matches(lp, row)
    assert max(lp.rank for lp in output.logprobs) > 1  # drawn hot: not always the most likely token


def test_streamed_deltas_carry_one_logprob_per_token(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)

    async def collect() -> list:
        return [delta async for delta in llm.stream(PROMPTS[1], params)]

    deltas = asyncio.run(collect())
    assert [lp.token_id for d in deltas for lp in d.logprobs] == [t for d in deltas for t in d.token_ids]
    assert deltas[-1].output.logprobs == [lp for d in deltas for lp in d.logprobs]


def assert_rank_matches(lp, row: torch.Tensor) -> None:
    """``lp.rank`` counts the tokens at least as likely as ``lp.token_id`` under ``row`` (near-ties either way)."""
    value = row[lp.token_id].item()
    assert int((row > value + ATOL).sum()) + 1 <= lp.rank <= int((row >= value - ATOL).sum())


def assert_prompt_logprobs_match(hf, prompt: list[int], entries: list, k: int) -> None:
    reference = hf_log_probs(hf, prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    for position, lp in enumerate(entries[1:], start=1):
        row = reference[position - 1]
        assert lp.token_id == prompt[position]
        assert lp.logprob == pytest.approx(row[prompt[position]].item(), abs=ATOL)
        assert [t for t, _ in lp.top] == row.topk(k).indices.tolist()
        assert_rank_matches(lp, row)


def test_prompt_logprobs_are_transformers_log_softmax_even_over_chunks_and_a_cached_prefix(built, hf, tmp_path):
    build_native_engine(built / "checkpoint", tmp_path, tiny_plan(max_num_tokens=16), "float32")
    prompt = [(7 * i + 3) % 90 + 2 for i in range(40)]  # longer than one step's 16-token budget: chunked
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    with LLM.load(tmp_path) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1))  # the prompt's blocks are now in the prefix cache
        output = llm.generate([prompt], params)[0]
    assert_prompt_logprobs_match(hf, prompt, output.prompt_logprobs, 3)


def test_a_request_without_logprobs_gets_none(llm):
    output = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0]
    assert output.logprobs is None


@pytest.mark.parametrize("penalty", [1.8, 0.5])
def test_repetition_penalty_follows_transformers(llm, hf, penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    for prompt in PROMPTS:
        expected = hf_greedy(hf, prompt, STEPS, RepetitionPenaltyLogitsProcessor(penalty))
        assert expected != greedy(llm, prompt)  # the penalty changes this greedy completion
        assert greedy(llm, prompt, repetition_penalty=penalty) == expected


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.7), (-0.5, 1.2)])
def test_presence_and_frequency_penalties_follow_openai(llm, hf, presence, frequency):
    def openai_penalties(input_ids: torch.Tensor, scores: torch.Tensor, *, prompt_len: int) -> torch.Tensor:
        # OpenAI's definition: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c counting the completion's tokens
        counts = torch.bincount(input_ids[0, prompt_len:], minlength=scores.shape[-1]).float()
        return scores - counts * frequency - (counts > 0).float() * presence

    for prompt in PROMPTS:
        expected = hf_greedy(hf, prompt, STEPS, functools.partial(openai_penalties, prompt_len=len(prompt)))
        assert expected != greedy(llm, prompt)
        assert greedy(llm, prompt, presence_penalty=presence, frequency_penalty=frequency) == expected


def test_penalties_count_the_token_of_a_step_still_in_flight(built, hf):
    """With overlapped steps the next step is sampled before the host has the last token: the penalty must see it."""
    from transformers import RepetitionPenaltyLogitsProcessor

    expected = hf_greedy(hf, PROMPTS[0], STEPS, RepetitionPenaltyLogitsProcessor(2.0))
    for overlap in (True, False):
        with LLM.load(built / "engine", RuntimeOptions(overlap_steps=overlap)) as llm:
            assert greedy(llm, PROMPTS[0], repetition_penalty=2.0) == expected, overlap


def test_logit_bias_forces_and_bans_tokens(llm):
    free = greedy(llm, PROMPTS[0])
    assert greedy(llm, PROMPTS[0], logit_bias={7: 100.0}) == [7] * STEPS
    banned = greedy(llm, PROMPTS[0], logit_bias={free[0]: -100.0})
    assert banned[0] != free[0] and free[0] not in banned


def test_min_tokens_holds_back_stop_tokens_until_then(llm):
    # the bias makes token 7 the likeliest every step: as a stop token it ends the request at once, unless min_tokens
    params = dict(temperature=0, max_tokens=STEPS, logit_bias={7: 100.0}, stop_token_ids=[7])
    assert llm.generate([PROMPTS[0]], SamplingParams(**params))[0].token_ids == [7]
    output = llm.generate([PROMPTS[0]], SamplingParams(**params, min_tokens=5))[0]
    assert len(output.token_ids) == 6 and 7 not in output.token_ids[:5]
    assert output.token_ids[5] == 7 and output.finish_reason == "stop"


def test_controls_and_logprobs_cross_the_engine_process(built):
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3, logit_bias={7: 100.0})
    stopped = SamplingParams(temperature=0, max_tokens=STEPS, logit_bias={7: 100.0}, stop_token_ids=[7])
    with LLM.load(built / "engine") as here, LLM(ProcessEngine.load(built / "engine", RuntimeOptions())) as apart:
        local, remote = here.generate([PROMPTS[0]], params)[0], apart.generate([PROMPTS[0]], params)[0]
        assert apart.generate([PROMPTS[0]], stopped)[0].stop_reason == 7
    assert remote.token_ids == local.token_ids == [7] * STEPS
    # the same numbers up to the last bits: on a GPU two processes' kernels may sum in a different order
    assert [[t for t, _ in lp.top] for lp in remote.logprobs] == [[t for t, _ in lp.top] for lp in local.logprobs]
    assert [v for lp in remote.logprobs for _, v in lp.top] == pytest.approx(
        [v for lp in local.logprobs for _, v in lp.top], abs=1e-5)
    assert [lp.logprob for lp in remote.logprobs] == pytest.approx([lp.logprob for lp in local.logprobs], abs=1e-5)


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match=r"\(in logit_bias\) are outside the vocabulary"):  # the field named
        llm.generate([PROMPTS[0]], SamplingParams(logit_bias={10**6: 1.0}))
