"""Sampling parameters, the sampler, incremental detokenization and the stop conditions."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import os
import shutil
from pathlib import Path

import pytest
import tokenizers
import tokenizers.processors
import torch

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.errors import InvalidRequestError, SamplingError
from kiln.runtime.native.logit_controls import apply_logit_controls
from kiln.runtime.native.sampler import Sampler, apply_top_k_top_p, request_generator
from kiln.runtime.sequence import Sequence
from kiln.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.model_factories import build_tiny_engine
from tests.test_server_support import tiny_engine

PROMPT = [5, 17, 33, 8, 61, 12]
TINY_LLAMA = Path(__file__).resolve().parents[1] / "models" / "tiny-llama"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM.load(build_tiny_engine(tmp_path_factory.mktemp("native"), seed=2)) as llm:
        yield llm


def greedy(llm: LLM, max_tokens: int = 16) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize(("field", "value", "words"), [
    ("temperature", -0.5, "temperature must be a finite number >= 0"),
    ("temperature", float("nan"), "temperature must be a finite number >= 0"),
    ("temperature", float("inf"), "temperature must be a finite number >= 0"),
    ("top_k", -3, "top_k must be an int >= 1, or 0/-1"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("max_tokens", 0, "max_tokens must be an int >= 1"),
    ("seed", 1.5, "seed must be an int or None"),
    ("seed", 2**64, r"seed must be in \[0, 2\*\*64 - 1\]"),
    ("seed", -2, r"seed must be in \[0, 2\*\*64 - 1\]"),
    ("stop", [""], "stop must be non-empty strings"),
    ("stop_token_ids", [-1], "stop_token_ids must be token ids >= 0"),
    ("top_p", True, r"top_p must be in \(0, 1\]"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
    ("ignore_eos", "no", "ignore_eos must be True or False"),
    ("detokenize", 0, "detokenize must be True or False"),
    ("stop", 3, "stop must be a list or None"),
    ("logit_bias", [1, 2], "logit_bias must be a dict or None"),
    ("skip_special_tokens", 0, "skip_special_tokens must be True or False"),
    ("allowed_token_ids", [], "allowed_token_ids must be None or a non-empty list of token ids"),
    ("allowed_token_ids", [3, -1], "allowed_token_ids must be None or a non-empty list of token ids"),
])
def test_sampling_params_reject_bad_values_with_a_clear_message(field, value, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**{field: value})


def test_a_seed_of_minus_one_is_no_seed_as_in_vllm():
    from kiln.runtime.server.generation import sampling_params
    from kiln.runtime.server.protocol import CompletionRequest

    assert SamplingParams(seed=-1).seed is None
    request = CompletionRequest(model="m", prompt="hi", seed=-1, n=2)
    assert [sampling_params(request, max_tokens=4, index=i, logprobs=None, prompt_logprobs=None,
                            structured_output=None, defaults={}).seed for i in range(2)] == [None, None]


@pytest.mark.parametrize(("name", "words"), [
    ("max_new_tokens", "no setting 'max_new_tokens': set max_tokens"),  # SGLang's name
    ("temprature", "did you mean temperature"),
])
def test_a_setting_samplingparams_lacks_is_refused_not_dropped(name, words):
    params = SamplingParams(temperature=0)
    with pytest.raises(AttributeError, match=words):
        setattr(params, name, 3)
    with pytest.raises(TypeError, match=words):
        SamplingParams(**{name: 3})
    params.max_tokens = 5  # its own settings are set as before
    assert params.max_tokens == 5


def test_vllms_settings_at_values_that_change_nothing_are_taken_and_others_refused():
    spelled_out = SamplingParams(temperature=0, include_stop_str_in_output=False, best_of=1, bad_words=[],
                                 use_beam_search=False, guided_decoding=None, spaces_between_special_tokens=True)
    assert spelled_out == SamplingParams(temperature=0)
    spelled_out.include_stop_str_in_output = False  # set later too
    assert SamplingParams(n=3, best_of=3).n == 3  # vLLM's best_of is n unless set: every sample returned
    with pytest.raises(ValueError, match="best_of only at a value that changes nothing .None or n., got 3: LLM.gen"):
        SamplingParams(n=2, best_of=3)
    with pytest.raises(ValueError, match="spaces_between_special_tokens only at .* .True., got False"):
        SamplingParams(spaces_between_special_tokens=False)
    with pytest.raises(ValueError, match=r"flat_logprobs only at a value that changes nothing \(False\), got True$"):
        SamplingParams(flat_logprobs=True)  # no "did you mean logprobs?": that is no substitute
    copied = spelled_out.clone()
    copied.stop.append("x")
    assert copied.stop == ["x"] and spelled_out.stop == []

    @dataclasses.dataclass
    class Tagged(SamplingParams):  # its own __init__ takes its fields only: refused with the advice
        tag: str = ""

    with pytest.raises(TypeError, match="no setting 'best_of'"):
        Tagged(best_of=1)
    for name, value in (("best_of", 2), ("bad_words", ["no"]), ("use_beam_search", 1)):  # 1 is no False
        with pytest.raises(ValueError, match=f"vLLM's {name} only at"):
            SamplingParams(**{name: value})


class RequestOutputKind(enum.Enum):  # vLLM's, which Kiln does not import
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@pytest.mark.parametrize(("name", "value", "words"), [
    ("structured_outputs", {"regex": "a+"}, "set structured_output, Kiln's name"),
    ("truncate_prompt_tokens", 8, r"\{'prompt_token_ids': llm.tokenizer.encode\(text\)\[-k:\]\}"),
    ("logits_processors", [print], "no Python logits processors; it changes logits with logit_bias"),
    ("extra_args", {"x": 1}, "changes logits with logit_bias, allowed_token_ids"),
    ("output_kind", RequestOutputKind.DELTA, r"\(RequestOutputKind.FINAL_ONLY\), got .*iterate LLM.stream"),
])
def test_vllms_settings_kiln_lacks_say_what_to_do_instead(name, value, words):
    with pytest.raises(ValueError, match=words):  # before: no advice, or a TypeError
        SamplingParams(**{name: value})


def test_what_vllms_llm_generate_returns_and_its_structured_outputs_dict_are_taken():
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY) == SamplingParams()
    as_dict = {"json": None, "regex": "a+", "choice": None, "grammar": None, "json_object": None}  # asdict(vLLM's)
    assert SamplingParams(structured_output=as_dict).structured_output.regex == "a+"


def test_settings_are_given_by_name_only_as_vllms_first_positional_one_is_n():
    with pytest.raises(TypeError, match=r"by name only, got 4 by position.*SamplingParams\(n=4\)"):
        SamplingParams(4)  # before: temperature=4


def test_n_counts_samples_as_an_int_of_at_least_one():
    assert SamplingParams(n=3).n == 3
    for n in (0, 1.0, True):  # a float or a bool is no count, even one equal to 1
        with pytest.raises(ValueError, match="n must be an int >= 1"):
            SamplingParams(n=n)


def test_a_subclass_of_samplingparams_takes_its_own_fields():
    @dataclasses.dataclass
    class Tagged(SamplingParams):
        tag: str = ""

    tagged = Tagged(tag="a", temperature=0)
    tagged.tag = "b"
    assert (tagged.tag, tagged.temperature) == ("b", 0)


def test_none_for_a_collection_is_the_empty_one():
    params = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None)
    assert (params.stop, params.stop_token_ids, params.logit_bias) == ([], [], {})


def test_logit_bias_takes_token_ids_as_a_json_object_spells_them():
    assert SamplingParams(logit_bias={"5": -100, 7: 2.5}).logit_bias == {5: -100, 7: 2.5}  # as OpenAI's and vLLM's
    for key in ("-5", "5a", "٥"):  # no token id: named as given (an Arabic-Indic digit is no ASCII one)
        with pytest.raises(ValueError, match=f"keys must be token ids >= 0, got '{key}'"):
            SamplingParams(logit_bias={key: 1})


def test_numbers_of_numpy_and_torch_are_taken_as_python_numbers():
    import numpy as np

    params = SamplingParams(temperature=np.float32(0.5), max_tokens=np.int64(4), seed=torch.tensor(7),
                            stop_token_ids=[np.int32(5)], logit_bias={np.int64(5): np.float64(10)},
                            logprobs=np.int8(2))
    assert (params.temperature, params.max_tokens, params.seed, params.stop_token_ids, params.logit_bias,
            params.logprobs) == (0.5, 4, 7, [5], {5: 10.0}, 2)
    assert type(params.max_tokens) is int and type(params.temperature) is float
    json.dumps(params.logit_bias)  # plain numbers cross to the engine process
    with pytest.raises(ValueError, match="max_tokens must be an int"):
        SamplingParams(max_tokens=np.float64(4))
    floats = SamplingParams(temperature=torch.tensor(0.5), top_p=torch.tensor(0.9, dtype=torch.float64))
    assert (floats.temperature, floats.top_p) == (0.5, 0.9) and type(floats.top_p) is float


def test_stop_strings_need_the_text():
    with pytest.raises(ValueError, match="stop needs detokenize=True"):
        SamplingParams(stop=["end"], detokenize=False)


def test_top_k_and_top_p_keep_only_the_most_likely_tokens():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3])).expand(5, -1)
    dropped = torch.isinf(apply_top_k_top_p(logits, [2, 0, 0, -1, 3], [1.0, 0.7, 0.85, 1.0, 0.7])).tolist()
    assert dropped == [[True, False, True, False], [True, False, True, False], [True, False, False, False],
                       [False, False, False, False], [True, False, True, False]]
    assert torch.isinf(apply_top_k_top_p(logits[:2], [2, 1], [1.0, 1.0])).tolist() == [  # top-k alone: torch.topk
        [True, False, True, False], [True, False, True, True]]
    tiny = apply_top_k_top_p(logits[:1], [0], [1e-300])  # a float32 limit of 0: the most likely token still stays
    assert torch.isinf(tiny).tolist() == [[True, False, True, True]]


def test_min_p_keeps_the_tokens_at_least_that_share_of_the_most_likely_one():
    from kiln.runtime.native.sampler import apply_min_p

    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3])).expand(4, -1)  # shares of 0.5: 0.1, 1, 0.3, 0.6
    assert torch.isinf(apply_min_p(logits, [0.0, 0.25, 0.35, 0.7])).tolist() == [
        [False] * 4, [True, False, False, False], [True, False, True, False], [True, False, True, True]]


def test_min_p_one_samples_what_greedy_decoding_picks(llm):
    hot = SamplingParams(temperature=5.0, min_p=1.0, max_tokens=16, seed=3, ignore_eos=True)
    assert llm.generate([PROMPT], hot)[0].token_ids == greedy(llm)


def one_row_filter(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The filters' definition, one row at a time."""
    if 0 < top_k < row.shape[-1]:
        row = row.masked_fill(row < torch.topk(row, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        sorted_row, order = torch.sort(row, descending=True)
        probs = sorted_row.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p
        row = row.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))
    return row


@pytest.mark.parametrize("with_top_p", [False, True], ids=["top-k-only", "top-k-and-top-p"])
def test_batched_filters_equal_each_row_filtered_alone(with_top_p):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=generator) * 3
    top_k, top_p = [0, 1, 5, 299, 300, 40], [1.0, 0.5, 0.9, 0.99, 0.3, 1.0] if with_top_p else [1.0] * 6
    expected = torch.stack([one_row_filter(logits[i], top_k[i], top_p[i]) for i in range(6)])
    torch.testing.assert_close(apply_top_k_top_p(logits, top_k, top_p), expected)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (2, 1.0), (0, 0.8)], ids=["full", "top-k", "top-p"])
def test_sampled_frequencies_follow_the_filtered_distribution(top_k, top_p):
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    logits = (probs.log() * 0.7).expand(40_000, -1).contiguous()  # at temperature 0.7: softmax = probs
    seqs = [Sequence(str(i), [1], SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)) for i in range(40_000)]
    counts = torch.bincount(torch.tensor(Sampler()(logits, seqs)), minlength=4).double() / 40_000
    kept = one_row_filter(probs.log(), top_k, top_p).softmax(-1).double()
    assert (counts[kept == 0] == 0).all()
    torch.testing.assert_close(counts, kept, atol=0.01, rtol=0)


def test_seeded_sampler_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def seqs() -> list[Sequence]:
        return [Sequence(str(i), [1], SamplingParams(temperature=1.0, seed=i)) for i in range(3)]

    sampler = Sampler()
    batch, alone = seqs(), seqs()
    batched = [sampler(logits, batch) for _ in range(5)]
    solo = [sampler(logits[2:], alone[2:]) for _ in range(5)]
    assert [row[2] for row in batched] == [row[0] for row in solo]


def test_the_largest_seed_is_accepted_and_reproducible():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))

    def sample() -> list[int]:
        seq = Sequence("big", [1], SamplingParams(temperature=1.0, seed=2**64 - 1))
        return [Sampler()(logits, [seq])[0] for _ in range(4)]

    assert sample() == sample()


def test_a_temperature_too_small_to_divide_by_samples_greedily():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seqs = [Sequence(str(i), [1], SamplingParams(temperature=t, seed=i)) for i, t in enumerate((1e-300, 5e-324, 1e-6))]
    assert all(seq.params.greedy for seq in seqs)
    assert Sampler()(logits, seqs) == logits.argmax(-1).tolist()


def test_small_penalties_and_biases_on_bf16_logits_are_not_rounded_away():
    logits = torch.tensor([[20.0, 20.0, 12.0, 3.0]] * 2, dtype=torch.bfloat16)  # a bf16 step near 20 is 0.125
    biased = Sequence("bias", [1], SamplingParams(temperature=0, logit_bias={1: 0.05}))
    penalized = Sequence("penalty", [1], SamplingParams(temperature=0, frequency_penalty=0.05))
    penalized.append_token(0)  # once in the completion
    controlled = apply_logit_controls(logits, [biased, penalized], stop_token_ids=())
    assert controlled.dtype == torch.float32
    assert controlled[0, 1].item() == pytest.approx(20.05) and controlled[1, 0].item() == pytest.approx(19.95)
    assert Sampler()(logits, [biased, penalized]) == [1, 1]  # a bias can break a tie


@pytest.mark.parametrize("asked", [dict(ignore_eos=True), dict(min_tokens=2)])
def test_a_structured_output_refuses_what_it_would_silently_override(asked):
    with pytest.raises(ValueError, match=f"{next(iter(asked))} cannot be combined with a structured output"):
        SamplingParams(structured_output={"choice": ["yes", "no"]}, **asked)


def test_min_tokens_holds_back_eos_even_when_eos_is_ignored_as_in_vllm():
    seq = Sequence("r", [1], SamplingParams(temperature=0, min_tokens=4, ignore_eos=True))
    controlled = apply_logit_controls(torch.zeros(1, 5), [seq], stop_token_ids={2})
    assert controlled[0, 2] == float("-inf")
    past = apply_logit_controls(torch.zeros(1, 5), [seq], stop_token_ids={2, 7})  # an older engine's EOS past the
    assert past[0, 2] == float("-inf") and past[0, 3] == 0  # vocabulary: before, an IndexError that stopped the engine


def test_a_row_that_cannot_be_sampled_gets_a_sampling_error_and_the_others_their_tokens():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[4] = float("-inf")  # no token allowed (allowed_token_ids and a grammar with none in common)

    def seqs(temperature: float = 1.0) -> list[Sequence]:
        return [Sequence(str(i), [1], SamplingParams(temperature=temperature, seed=i)) for i in range(5)]

    for temperature in (1.0, 0.0):  # drawn, and greedy (where a NaN would win the argmax)
        sampled = Sampler()(logits, seqs(temperature))
        for row in (1, 2, 4):
            assert isinstance(sampled[row], SamplingError)
            assert f"request {row}: no token could be sampled" in str(sampled[row])
        assert "no token is allowed" in str(sampled[4])
        alone = seqs(temperature)
        assert [sampled[0], sampled[3]] == [Sampler()(logits[[i]], [alone[i]])[0] for i in (0, 3)]


def test_top_k_one_equals_greedy(llm):
    sampled = llm.generate([PROMPT], SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=16,
                                                    ignore_eos=True))[0]
    assert sampled.token_ids == greedy(llm)


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in (1, 2)]
    batched = llm.generate([[9, 9, 9], PROMPT, list(range(3, 30))], [others[0], params, others[1]])
    assert batched[1].token_ids == alone
    assert llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=8, max_tokens=16,
                                                 ignore_eos=True))[0].token_ids != alone


def test_stop_token_id_ends_the_request_and_keeps_the_token_out_of_the_text(llm):
    reference = greedy(llm)
    stop_id = reference[5]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)  # vLLM's stop_reason: the id
    assert out.token_ids == reference[:reference.index(stop_id) + 1]
    assert out.text == "".join(f" t{t}" for t in out.token_ids[:-1])
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id],
                                                 include_stop_str_in_output=True))[0]
    assert (kept.token_ids, kept.text) == (out.token_ids, out.text + f" t{stop_id}")  # as vLLM keeps it


def test_stop_string_across_tokens_cuts_the_text_before_it(llm):
    reference = greedy(llm)
    stop = f"t{reference[3]} t{reference[4]}"
    full_text = "".join(f" t{t}" for t in reference)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, stop=["never seen", stop]))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == full_text[:full_text.index(stop)]
    assert out.token_ids == reference[:len(out.token_ids)] and len(out.token_ids) <= 5
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, stop=stop[:-1],  # ends in a token
                                                 include_stop_str_in_output=True))[0]
    assert kept.text == full_text[:full_text.index(stop) + len(stop) - 1] and kept.stop_reason == stop[:-1]


def test_max_tokens_ends_the_request_with_reason_length(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7 and out.stop_reason is None


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_allowed_token_ids_are_the_only_tokens_sampled(llm, temperature):
    allowed = [t for t in range(3, 10) if t not in greedy(llm)][:2]
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed,
                            logprobs=1)
    out = llm.generate([PROMPT], params)[0]
    assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 16
    assert out.logprobs[0].top[0][0] == greedy(llm, 1)[0]  # the model's distribution, as for logit_bias


def test_allowed_token_ids_outside_the_vocabulary_are_refused_naming_the_field(llm):
    with pytest.raises(InvalidRequestError, match=r"\[100000\] \(in allowed_token_ids\) are outside the vocabulary"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[5, 100000]))


@pytest.fixture(scope="module")
def tiny_llama() -> LLM:
    """The tiny engine with the bundled byte-level BPE, whose special tokens are <s> (0), </s> (1, EOS), <pad>."""
    with LLM.load(tiny_engine()) as loaded:
        yield loaded


@pytest.mark.parametrize(("skip", "text"), [(True, ""), (False, "<s><s><s>")])
def test_skip_special_tokens_false_keeps_generated_special_tokens_in_the_text(tiny_llama, skip, text):
    params = SamplingParams(temperature=0, max_tokens=3, logit_bias={0: 100}, skip_special_tokens=skip)  # <s> thrice
    out = tiny_llama.generate("Hi", params)[0]
    assert (out.token_ids, out.text) == ([0, 0, 0], text)

    async def streamed() -> str:
        return "".join([delta.text async for delta in tiny_llama.stream("Hi", params)])

    assert asyncio.run(streamed()) == text


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    """The bundled tiny model's byte-level BPE: multi-byte characters split across tokens."""
    return Tokenizer.from_dir(TINY_LLAMA)


def test_tokenizer_encodes_and_decodes_like_transformers(tiny_tokenizer):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(TINY_LLAMA)
    for text in ["The kiln fires the clay.", "  two spaces, naïve café 🔥", "1200 °C\nnext line"]:
        ids = reference(text)["input_ids"]
        assert tiny_tokenizer.encode(text) == ids
        assert tiny_tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("post_processor", [True, False], ids=["adds-bos", "adds-nothing"])
@pytest.mark.parametrize("add_bos_token", [True, False])
def test_bos_comes_from_the_post_processor_alone_as_in_transformers(tmp_path, caplog, post_processor, add_bos_token):
    from transformers import AutoTokenizer

    hf = tokenizers.Tokenizer.from_file(str(TINY_LLAMA / "tokenizer.json"))
    bos = hf.token_to_id("<s>")
    if post_processor:
        hf.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    hf.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((TINY_LLAMA / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": add_bos_token}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert ("adds no BOS" in caplog.text) == (add_bos_token and not post_processor)  # what changed is said
    body = tokenizer.encode("Hello there", add_special_tokens=False)
    assert bos not in body
    assert tokenizer.encode("Hello there") == AutoTokenizer.from_pretrained(tmp_path)("Hello there")["input_ids"] == (
        [bos, *body] if post_processor else body)
    assert tokenizer.encode("<s>Hello there", add_special_tokens=False) == [bos, *body]  # a chat template's BOS


def test_a_tokenizer_loads_from_a_directory_whose_name_is_not_utf8(tmp_path, tiny_tokenizer):
    directory = tmp_path / os.fsdecode(b"lat\xe9in1")
    directory.mkdir()
    shutil.copyfile(TINY_LLAMA / "tokenizer.json", directory / "tokenizer.json")
    assert Tokenizer.from_dir(directory).encode("naïve café") == tiny_tokenizer.encode("naïve café")


def test_incremental_detokenization_matches_decoding_everything(tiny_tokenizer):
    prompt = tiny_tokenizer.encode("the kiln")
    completion = tiny_tokenizer.encode(" fires at 1200 °C: naïve 🔥 crème")
    detokenizer = IncrementalDetokenizer(tiny_tokenizer, prompt, stop=[])
    streamed = ""
    for token_id in completion:
        assert detokenizer.add_token(token_id) is None
        streamed += detokenizer.take_delta(finished=False)
    streamed += detokenizer.take_delta(finished=True)
    assert detokenizer.text == streamed == " fires at 1200 °C: naïve 🔥 crème"


def test_a_completion_cut_inside_a_character_keeps_its_bytes_as_replacement_characters(tiny_tokenizer):
    detokenizer = IncrementalDetokenizer(tiny_tokenizer, tiny_tokenizer.encode("the kiln"), stop=[])
    fire = tiny_tokenizer.encode(" 🔥", add_special_tokens=False)
    assert len(fire) > 2  # byte tokens: the last ones complete the character
    for token_id in fire[:-1]:
        detokenizer.add_token(token_id)
    assert detokenizer.take_delta(finished=False) == " "  # held back while the character may still complete
    assert detokenizer.take_delta(finished=True) == tiny_tokenizer.decode(fire[:-1])[1:]
    assert detokenizer.text.endswith("\ufffd")


def test_stop_strings_count_from_min_tokens_on_as_in_vllm(tiny_tokenizer):
    completion = tiny_tokenizer.encode(" Monday, Tuesday, Wednesday, Thursday", add_special_tokens=False)
    first_comma = tiny_tokenizer.encode(" Monday,", add_special_tokens=False)
    texts = []
    # vLLM looks once there are more than min_tokens tokens, in the text they add: at len(first_comma) the comma
    # that token wrote is past
    for min_tokens in (0, len(first_comma) - 1, len(first_comma), len(first_comma) + 1):
        detokenizer = IncrementalDetokenizer(tiny_tokenizer, tiny_tokenizer.encode("Days:"), [","], min_tokens)
        stopped = next((stop for token_id in completion if (stop := detokenizer.add_token(token_id))), None)
        texts.append((stopped, detokenizer.text))
    assert texts == [(",", " Monday")] * 2 + [(",", " Monday, Tuesday")] * 2


def test_streamed_text_never_shows_a_stop_string(tiny_tokenizer):
    prompt = tiny_tokenizer.encode("the kiln")
    detokenizer = IncrementalDetokenizer(tiny_tokenizer, prompt, stop=["°C", "zzz"])
    streamed, stopped = "", None
    for token_id in tiny_tokenizer.encode(" fires at 1200 °C and cools"):
        stopped = detokenizer.add_token(token_id)
        streamed += detokenizer.take_delta(finished=stopped is not None)
        assert "°" not in streamed
        if stopped:
            break
    assert stopped == "°C" and streamed == detokenizer.text == " fires at 1200 "


def test_with_the_stop_string_kept_the_text_streams_without_holding_a_tail_back(tiny_tokenizer):
    detokenizer = IncrementalDetokenizer(tiny_tokenizer, tiny_tokenizer.encode("the kiln"), stop=["zzzzzz"],
                                         include_stop=True)  # nothing sent can be taken back: vLLM holds none
    for token_id in tiny_tokenizer.encode(" fires hot"):
        detokenizer.add_token(token_id)
        assert detokenizer.take_delta(finished=False) != ""
    assert detokenizer.text == " fires hot"


@pytest.fixture(scope="module")
def byte_fallback() -> tuple[Tokenizer, dict[str, int]]:
    """A Llama-2-style SentencePiece BPE (and its vocabulary): characters it lacks are <0xNN> byte tokens, which its
    decoder writes U+FFFD for, one per byte, where their run is not valid UTF-8."""
    from tokenizers import decoders, models, normalizers

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "H", "e", "l", "o", "x", "語"]
    merges = [("\u2581", "H"), ("\u2581H", "e"), ("\u2581He", "l"), ("\u2581Hel", "l"), ("\u2581Hell", "o")]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    vocab.update({left + right: len(vocab) + i for i, (left, right) in enumerate(merges)})
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(hf), vocab


def byte_tokens(vocab: dict[str, int], data: bytes) -> list[int]:
    return [vocab[f"<0x{b:02X}>"] for b in data]


def streamed_text(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> str:
    """The completion text streamed as ``token_ids`` come, checked to be the final text."""
    streamed = ""
    for token_id in token_ids:
        detokenizer.add_token(token_id)
        streamed += detokenizer.take_delta(finished=False)
    streamed += detokenizer.take_delta(finished=True)
    assert streamed == detokenizer.text
    return streamed


def test_a_prompt_ending_inside_a_character_leaves_it_to_the_completion(byte_fallback, tiny_tokenizer):
    from kiln.runtime.server.logprobs import TextOffsets

    tokenizer, vocab = byte_fallback
    prompt = [vocab["<s>"], vocab["\u2581Hello"], *byte_tokens(vocab, "中".encode()[:2])]
    finish, e, hello = byte_tokens(vocab, "中".encode()[2:]), vocab["e"], vocab["\u2581Hello"]
    completions = [[*finish, e, e, e], [*finish, hello], [*finish, *byte_tokens(vocab, "文".encode())], [e]]
    texts = [streamed_text(IncrementalDetokenizer(tokenizer, prompt, []), completion) for completion in completions]
    assert texts == ["中eee", "中 Hello", "中文", "\ufffd\ufffde"]  # as decoding the prompt with them writes it
    assert TextOffsets(tokenizer, prompt).take([*finish, e]) == [0, 1]
    # the byte-level BPE: the character's last byte is a token of its own
    prompt = tiny_tokenizer.encode("Hello 中", add_special_tokens=False)
    (finish,), e = prompt[-1:], tiny_tokenizer.encode("e", add_special_tokens=False)
    assert tiny_tokenizer.token_bytes(finish) == "中".encode()[-1:]
    assert streamed_text(IncrementalDetokenizer(tiny_tokenizer, prompt[:-1], []), [finish, *e]) == "中e"


def test_a_prompt_context_never_starts_inside_a_character(byte_fallback):
    tokenizer, vocab = byte_fallback
    prompt = [vocab["<s>"], vocab["\u2581Hello"], *byte_tokens(vocab, "🚀中".encode())]  # its last 6 start in 🚀
    completion = byte_tokens(vocab, "文".encode())
    assert streamed_text(IncrementalDetokenizer(tokenizer, prompt, []), completion) == "文"


def test_an_invalid_byte_after_whole_characters_keeps_them_and_adds_one_replacement_per_byte(byte_fallback):
    from kiln.runtime.server.logprobs import TextOffsets

    tokenizer, vocab = byte_fallback
    completion = [*byte_tokens(vocab, "䭸".encode() + b"\x80"), vocab["e"], *byte_tokens(vocab, b"\xa9")]
    assert tokenizer.decode(completion) == "\ufffd" * 4 + "e\ufffd"  # decoded whole, 䭸 is lost too
    assert streamed_text(IncrementalDetokenizer(tokenizer, [vocab["<s>"]], []), completion) == "䭸\ufffde\ufffd"
    assert TextOffsets(tokenizer, [vocab["<s>"]]).take(completion) == [0, 0, 0, 1, 2, 3]


def test_a_cpu_generator_draws_differently_for_seeds_that_differ_only_above_bit_32():
    def draws(seed: int) -> list[float]:
        return torch.rand(4, generator=request_generator(seed, torch.device("cpu"))).tolist()

    assert draws(1) != draws(2**32 + 1) and draws(0) != draws(2**40)
    # neighbours a fold of the high half into the low one collided: OpenAI's -1 (2**64 - 1) and its choice 1 (0),
    # 2**63 - 1 and 2**63, 0 and 2**32 + 1
    assert draws(2**64 - 1) != draws(0) and draws(2**63 - 1) != draws(2**63) and draws(0) != draws(2**32 + 1)
    assert draws(12345) == torch.rand(4, generator=torch.Generator().manual_seed(12345)).tolist()  # below 2**32: as is


def test_text_offsets_start_each_token_after_the_whole_characters_before_it():
    from tokenizers import decoders, models, pre_tokenizers

    from kiln.runtime.server.logprobs import TextOffsets

    # a byte-level BPE whose tokens join whole characters to a piece of the next (" " + 😀's first byte, "ra" + ß's)
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("Ġ", "ð"), ("r", "a"), ("ra", "Ã")]
    vocab.update({left + right: len(vocab) + i for i, (left, right) in enumerate(merges)})
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = Tokenizer(hf)
    ids = tokenizer.encode("a 😀 traße", add_special_tokens=False)
    assert {vocab["Ġð"], vocab["raÃ"]} <= set(ids)
    # a token's offset is what the tokens before it decode to in whole characters
    expected = [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert TextOffsets(tokenizer, []).take(ids) == expected
    halves = TextOffsets(tokenizer, [])
    assert halves.take(ids[:3]) + halves.take(ids[3:]) == expected  # streamed as the engine grows the text
    # a lead byte that the next token does not continue is a whole U+FFFD before it: "\xc3," "\xc3\xc3\xa9" "x"
    invalid = [vocab[c] for c in ("Ã", ",", "Ã", "Ã", "©", "x")]
    assert tokenizer.decode(invalid) == "\ufffd,\ufffdéx"
    assert TextOffsets(tokenizer, []).take(invalid) == [0, 1, 2, 3, 3, 4]


def test_text_offsets_of_byte_fallback_pieces_start_at_their_character(byte_fallback):
    from kiln.runtime.server.logprobs import TextOffsets

    tokenizer, vocab = byte_fallback
    ids = [*byte_tokens(vocab, "🚀".encode()), vocab["e"], vocab["語"], vocab["x"]]  # U+FFFD per byte until 🚀
    assert tokenizer.decode(ids) == "🚀e語x"
    assert TextOffsets(tokenizer, []).take(ids) == [0, 0, 0, 0, 1, 2, 3]


def test_a_text_two_tokens_share_keeps_the_likelier_value_in_legacy_top_logprobs():
    from kiln.runtime.outputs import TokenLogprob
    from kiln.runtime.server.logprobs import completion_logprobs

    class Names:  # tokens 1 and 2 are pieces of characters: both read U+FFFD
        def text(self, token_id):
            return {1: "\ufffd", 2: "\ufffd", 3: "a"}[token_id]

    chosen = TokenLogprob(token_id=2, logprob=-6.9, top=((1, -0.4), (3, -1.2)), rank=3)
    lists = completion_logprobs(Names(), [chosen], [0])
    assert lists.token_logprobs == [-6.9] and lists.top_logprobs == [{"\ufffd": -0.4, "a": -1.2}]
    assert lists.token_logprobs[0] < max(lists.top_logprobs[0].values())  # not greedy, as a harness must see


def test_token_bytes_spell_added_tokens_and_padding_rows_as_decode_does():
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    from kiln.runtime.outputs import TokenLogprob
    from kiln.runtime.server.logprobs import TokenText, chat_logprobs

    byte_level = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "Ġ": 2}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.add_tokens([AddedToken("‹｜User｜>", special=False), AddedToken(" two words", special=False)])
    tokenizer = Tokenizer(byte_level)  # DeepSeek-R1-Distill's ‹｜User｜> is an added token that is not special
    for token_id in (0, 2, 3, 4):  # before: the characters outside the byte alphabet as 0 bytes
        assert tokenizer.token_bytes(token_id) == byte_level.decode([token_id]).encode()
    padding = 7  # a row of the model's past the tokenizer's vocabulary (Qwen2.5: 152,064 rows, 151,665 tokens)
    assert tokenizer.token_bytes(padding) == b"" and tokenizer.text_bytes([0, padding, 1]) == b"ab"
    entries = chat_logprobs(TokenText(tokenizer), [TokenLogprob(padding, -0.1, [(padding, -0.1), (3, -2.0)], 1)])
    assert [(e.token, e.bytes) for e in [entries.content[0], *entries.content[0].top_logprobs]] == [
        ("", []), ("", []), ("‹｜User｜>", list("‹｜User｜>".encode()))]  # before: a ValueError, a 500
