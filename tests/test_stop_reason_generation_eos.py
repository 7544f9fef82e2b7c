"""``stop_reason`` of a completion that ends on an EOS id, as vLLM gives it: None for the tokenizer's own
``eos_token``, the id for generation_config.json's others (vLLM adds those to ``stop_token_ids``)."""

from __future__ import annotations

import json

import pytest

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.outputs import finish_reason
from kiln.runtime.sequence import Sequence
from kiln.runtime.tokenizer import Tokenizer
from kiln.runtime.tokenizer_files import tokenizer_eos_id
from tests.model_factories import make_hf_checkpoint, tiny_plan, write_tokenizer

PROMPT = [5, 17, 33, 8, 61, 12]
TOKENIZER_EOS = 2  # the tiny tokenizer's eos_token, t2
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ended_on(token_id: int, eos_token_id: int | None = TOKENIZER_EOS, **params) -> tuple[str | None, int | None]:
    seq = Sequence("r", PROMPT, SamplingParams(max_tokens=8, **params))
    seq.append_token(token_id)
    return finish_reason(seq, token_id, None, frozenset({TOKENIZER_EOS, 7}), eos_token_id), seq.stop_reason


@pytest.mark.parametrize(("token_id", "eos_token_id", "params", "expected"), [
    (TOKENIZER_EOS, TOKENIZER_EOS, {}, ("stop", None)),
    (7, TOKENIZER_EOS, {}, ("stop", 7)),  # Llama 3.1's <|eom_id|>, say
    (7, TOKENIZER_EOS, {"ignore_eos": True}, (None, None)),  # vLLM adds no stop token then
    (TOKENIZER_EOS, TOKENIZER_EOS, {"ignore_eos": True, "stop_token_ids": [TOKENIZER_EOS]}, ("stop", TOKENIZER_EOS)),
    (TOKENIZER_EOS, None, {}, ("stop", TOKENIZER_EOS)),  # no tokenizer EOS: every EOS id is a stop token, as vLLM's
])
def test_only_the_tokenizers_eos_ends_with_stop_reason_none(token_id, eos_token_id, params, expected):
    assert ended_on(token_id, eos_token_id, **params) == expected


@pytest.fixture(scope="module")
def every_token_ends(tmp_path_factory):
    """The tiny engine whose generation_config.json names every id from 2 up as EOS: its first token ends it."""
    from kiln.engines.native.builder import build_native_engine

    root = tmp_path_factory.mktemp("generation-eos")
    checkpoint = make_hf_checkpoint(root / "checkpoint", seed=2)
    vocab_size = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(2, vocab_size))}))
    (root / "engine").mkdir()
    build_native_engine(checkpoint, root / "engine", tiny_plan(), "float32", device="cpu")
    with LLM.load(root / "engine") as llm:
        yield llm


def test_generation_config_eos_id_is_the_stop_reason_and_stays_out_of_the_text(every_token_ends):
    first = every_token_ends.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    token = first.token_ids[0]
    assert token > TOKENIZER_EOS  # the seed's first token: one of generation_config.json's other EOS ids
    out = every_token_ends.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids, out.text) == ("stop", token, [token], "")
    kept = every_token_ends.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8,
                                                              include_stop_str_in_output=True))[0]
    assert (kept.stop_reason, kept.text) == (token, f" t{token}")


@pytest.mark.parametrize(("config", "special_tokens_map", "expected"), [
    ({}, {"eos_token": {"content": "t2", "special": True}}, 2),  # eos_token only in special_tokens_map.json
    ({"eos_token": "t3"}, {"eos_token": "t2"}, 2),  # a config without added_tokens_decoder: the map's overrides
    ({"eos_token": "t3", "added_tokens_decoder": {}}, {"eos_token": "t2"}, 3),  # one with it: the map is not read
])
def test_tokenizer_eos_as_transformers_resolves_it(tmp_path, config, special_tokens_map, expected):
    write_tokenizer(tmp_path, 8)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    eos_token_id = tokenizer_eos_id(tmp_path, Tokenizer.from_dir(tmp_path))
    assert eos_token_id == expected
    assert ended_on(TOKENIZER_EOS, eos_token_id) == ("stop", None if expected == TOKENIZER_EOS else TOKENIZER_EOS)
