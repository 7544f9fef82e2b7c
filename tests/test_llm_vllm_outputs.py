"""An output read as vLLM's quickstart reads it: ``output.prompt`` and ``output.outputs[0].text``; vLLM's LLM methods
that Kiln names otherwise."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

import kiln
from kiln.runtime import LLM, InvalidRequestError, RequestTooLongError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3)


def test_each_output_carries_its_text_prompt_and_its_completion_as_vllms_outputs(llm):
    ids = llm.tokenizer.encode("the sun")
    text, as_dict, as_ids = llm.generate(["the sun", {"prompt": "a dog"}, ids], GREEDY)
    assert (text.prompt, as_dict.prompt, as_ids.prompt) == ("the sun", "a dog", None)
    [completion] = text.outputs
    assert (completion.index, completion.text, completion.token_ids, completion.finish_reason) == (
        0, text.text, text.token_ids, text.finish_reason)
    assert completion.cumulative_logprob is None and completion.finished()  # no logprobs asked for
    assert as_ids.outputs[0].token_ids == text.token_ids
    completion.text = completion.text.strip() + "!"  # vLLM's are post-processed in place
    completion.token_ids.append(0)
    assert text.outputs[0].text == completion.text and text.token_ids == as_ids.token_ids


def test_the_cumulative_logprob_sums_the_tokens_logprobs(llm):
    [output] = llm.generate("the sun", SamplingParams(temperature=0, max_tokens=3, logprobs=0))
    assert output.outputs[0].cumulative_logprob == sum(lp.logprob for lp in output.logprobs)
    assert output.outputs[0].cumulative_logprob < 0


def test_vllms_reads_of_a_positions_logprobs_dict_say_what_token_logprob_holds(llm):
    [output] = llm.generate("the sun", SamplingParams(temperature=0, max_tokens=2, logprobs=1, prompt_logprobs=1))
    assert isinstance(output.outputs[0], kiln.CompletionOutput)
    lp = output.logprobs[0]
    for read in (lambda: lp[lp.token_id], lambda: output.prompt_logprobs[1][5]):
        with pytest.raises(TypeError, match=r"not subscriptable \(it is no vLLM dict .*\.token_id, with \.logprob"):
            read()  # before: a bare "not subscriptable"
    with pytest.raises(AttributeError, match=r"\.top, \[\(token_id, logprob\), \.\.\.\]"):
        lp.items()
    with pytest.raises(AttributeError, match=r"llm.tokenizer.decode\(\[lp.token_id\]\)"):
        _ = lp.decoded_token


def test_older_vllm_calls_say_how_kiln_takes_them(llm):
    ids = llm.tokenizer.encode("the sun")
    with pytest.raises(TypeError, match=r"llm.generate\(\[\{'prompt_token_ids': ids\}"):
        llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)  # before: "missing argument 'prompts'"
    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="got 2 conversations but 3 SamplingParams: pass one, or one per "
                                         "conversation$"):
        llm.chat([conversation] * 2, [GREEDY] * 3)


def test_submitted_streamed_and_awaited_requests_carry_their_prompt_too(llm):
    assert llm.result(llm.submit("the sun", GREEDY)).prompt == "the sun"

    async def both():
        awaited = await llm.generate_async({"prompt": "a dog"}, GREEDY)
        streamed = [delta async for delta in llm.stream("a cat", GREEDY)]
        return awaited, streamed[-1].output

    awaited, streamed = asyncio.run(both())
    assert (awaited.prompt, streamed.prompt) == ("a dog", "a cat")


def test_vllms_llm_methods_kiln_names_otherwise_say_what_to_use(llm):
    with pytest.raises(AttributeError, match="use llm.tokenizer"):
        llm.get_tokenizer()
    with pytest.raises(AttributeError, match=r"llm.stats\(\)"):
        llm.get_metrics()
    assert not hasattr(llm, "get_default_sampling_params") and not hasattr(llm, "generat")

    class Named(LLM):
        @property
        def broken(self) -> None:
            return self.engine.no_such_thing

    named = object.__new__(Named)  # no engine needed to read attributes
    named.engine = llm.engine
    with pytest.raises(AttributeError, match="'Named' object has no attribute 'get_tokenizer'"):
        named.get_tokenizer()
    with pytest.raises(AttributeError, match="no_such_thing"):  # a property's own error, not hidden
        _ = named.broken


def test_n_samples_of_each_prompt_come_in_one_output_seeded_seed_plus_i(llm):
    prompts = ["the sun", "a dog"]
    sampled = SamplingParams(temperature=1.0, max_tokens=4, seed=7, n=3)
    first, second = llm.generate(prompts, sampled)
    assert [c.index for c in first.outputs] == [0, 1, 2] and first.prompt == "the sun"
    alone = [llm.generate("the sun", SamplingParams(temperature=1.0, max_tokens=4, seed=7 + i))[0] for i in range(3)]
    assert [c.token_ids for c in first.outputs] == [o.token_ids for o in alone]
    assert first.token_ids == alone[0].token_ids and len(second.outputs) == 3
    assert dataclasses.replace(first, text="").outputs == first.outputs  # a field: copies and asdict keep them
    assert len(dataclasses.asdict(first)["outputs"]) == 3
    [one] = llm.generate(["a dog"], [SamplingParams(temperature=0, max_tokens=2, n=2)])
    assert one.outputs[0].token_ids == one.outputs[1].token_ids  # greedy: the same twice
    with pytest.raises(InvalidRequestError, match="LLM.generate and LLM.chat make n"):
        llm.submit("the sun", sampled)  # one request makes one completion
    llm.check("the sun", sampled)  # what generate takes
    with pytest.raises(RequestTooLongError):
        llm.check("the sun", SamplingParams(n=2, max_tokens=llm.limits.max_seq_len))
    assert first.num_cached_tokens == first.metrics.num_cached_tokens
