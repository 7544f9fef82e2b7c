"""Incremental detokenization over a byte-level BPE whose tokens cross character boundaries ("世" + the first bytes
of "界" in one token), checked against decoding the whole sequence."""

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

from kiln.runtime.server.logprobs import TextOffsets
from kiln.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

EOS = 0


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE trained on CJK, Hangul and emoji, so merges join the bytes of neighbouring characters."""
    hf = HFTokenizer(BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    corpus = ["你好世界 你好 世界和平 😀🎉👍🏽 naïve café Привет мир 안녕하세요 😀😀 emoji👨‍👩‍👧",
              "hello world the quick brown fox"] * 50
    hf.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return Tokenizer(hf)


def token_of(tokenizer: Tokenizer, data: bytes) -> int:
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == data)


def generate(tokenizer: Tokenizer, prompt: list[int], completion: list[int], stop: list[str],
             **kwargs) -> tuple[str, str | None, str]:
    """The text, stop string and streamed text of ``completion`` as an engine runs it: a token that completes a stop
    string or is EOS ends it, and so does the last of ``max_tokens`` = ``len(completion)``."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop, max_tokens=len(completion), **kwargs)
    streamed, stopped = "", None
    for token_id in completion:
        if token_id == EOS:
            detokenizer.end_with_stop_token(token_id)
            break
        if (stopped := detokenizer.add_token(token_id)) is not None:
            break
        streamed += detokenizer.take_delta(finished=False)
    streamed += detokenizer.take_delta(finished=True)
    return detokenizer.text, stopped, streamed


def read(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def continues(data: bytes, byte: bytes) -> bool:
    """Whether ``byte`` continues (or completes) a character whose first bytes end ``data``: its U+FFFD is then
    replaced, not followed by another character."""
    return len(read(data + byte)) == len(read(data)) and read(data).endswith("\ufffd")


def unfinished(data: bytes) -> bool:
    """Whether ``data`` ends in the first bytes of a character, which a next byte continues."""
    return any(continues(data, bytes([byte])) for byte in (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF))


def expected_text(tokenizer: Tokenizer, prompt: list[int], completion: list[int]) -> str:
    """The completion's text as decoding prompt and completion together writes it after the prompt's whole
    characters (a character the prompt leaves unfinished is the completion's)."""
    prompt_text = tokenizer.decode(prompt)
    if unfinished(tokenizer.text_bytes(prompt)):
        prompt_text = prompt_text[:-1]
    return tokenizer.decode(prompt + completion)[len(prompt_text):]


def test_a_stop_string_is_found_once_its_characters_are_whole(tokenizer):
    a = tokenizer.encode("a", add_special_tokens=False)
    hello = token_of(tokenizer, "世".encode() + "界".encode()[:2])  # 世 and the first bytes of 界
    peace = token_of(tokenizer, "界".encode()[2:] + "和".encode() + "平".encode()[:1])
    a_c3 = token_of(tokenizer, b"a\xc3")
    assert generate(tokenizer, a, [hello, peace], ["界"]) == ("世", "界", "世")
    assert generate(tokenizer, a, [hello, peace], ["界"], include_stop=True) == ("世界", "界", "世界")
    assert generate(tokenizer, a, [a_c3, EOS], ["a"]) == ("", "a", "")
    # min_tokens: a stop string must end in the text of the tokens after them
    assert generate(tokenizer, a, [hello, peace], ["世"], min_tokens=1) == ("世界和\ufffd", None, "世界和\ufffd")
    # at max_tokens the text ends as the completion does, U+FFFD for its unfinished character, and is searched
    assert generate(tokenizer, a, [hello, peace], ["和\ufffd"]) == ("世界", "和\ufffd", "世界")
    assert generate(tokenizer, a, [hello], ["\ufffd"]) == ("世", "\ufffd", "世")


def test_a_byte_level_decoder_inside_a_sequence_reads_each_token_as_its_bytes(tokenizer):
    hf = HFTokenizer.from_str(tokenizer.to_dict()["tokenizer_json"])
    hf.decoder = decoders.Sequence([decoders.ByteLevel()])  # LFM2's tokenizer.json writes it so
    wrapped = Tokenizer(hf)
    hello = token_of(tokenizer, "世".encode() + "界".encode()[:2])
    peace = token_of(tokenizer, "界".encode()[2:] + "和".encode() + "平".encode()[:1])
    assert wrapped.token_bytes(hello) == "世".encode() + "界".encode()[:2]
    assert generate(wrapped, tokenizer.encode("a", add_special_tokens=False), [hello, peace], ["界"]) == \
        ("世", "界", "世")


def test_a_prompt_whose_last_token_joins_an_invalid_byte_before_it_leaves_the_completion_its_characters(tokenizer):
    prompt = [*tokenizer.encode("A", add_special_tokens=False), token_of(tokenizer, b"\xf3"),
              token_of(tokenizer, b"\x89\xf0\x9f\x91")]  # f3 89 read as one U+FFFD, then 👍's first bytes
    completion = [token_of(tokenizer, b"\x8d")]
    assert generate(tokenizer, prompt, completion, [])[0] == expected_text(tokenizer, prompt, completion) == "👍"
    # ED A0..BF begins a UTF-16 surrogate, no character: Python's incremental decoder still holds it back
    prompt, completion = [token_of(tokenizer, b"\xed"), token_of(tokenizer, b"\xb9")], [token_of(tokenizer, b"\xd3")]
    assert generate(tokenizer, prompt, completion, [])[0] == expected_text(tokenizer, prompt, completion) == "\ufffd"
    assert TextOffsets(tokenizer, prompt).take(completion * 2) == [0, 1]


def test_text_offsets_after_a_token_that_completes_one_character_and_starts_another(tokenizer):
    prompt = [*tokenizer.encode("Hello", add_special_tokens=False), token_of(tokenizer, " 안".encode() + b"\xeb\x85")]
    completion = [token_of(tokenizer, b"\x88\xeb\x85")] * 3
    assert generate(tokenizer, prompt, completion, [])[0] == "녈녈녈\ufffd"
    assert TextOffsets(tokenizer, prompt).take(completion) == [0, 1, 2]


def expected_offsets(tokenizer: Tokenizer, prompt: list[int], completion: list[int]) -> list[int]:
    """Where each completion token starts: after the whole characters before it, and an unfinished one that it
    does not continue (as decoding all of them writes it)."""
    offsets = []
    for i, token_id in enumerate(completion):
        before = tokenizer.text_bytes(prompt + completion[:i])
        waits = unfinished(before) and continues(before, tokenizer.token_bytes(token_id)[:1])
        offsets.append(len(expected_text(tokenizer, prompt, completion[:i])) - waits)
    return offsets


def test_random_completions_read_as_decoding_them_with_the_prompt(tokenizer):
    rng = random.Random(0)
    crossing = [i for i in range(tokenizer.vocab_size) if not tokenizer.token_bytes(i).isascii()]
    others = range(3, tokenizer.vocab_size)
    for _ in range(300):
        prompt, completion = ([rng.choice(crossing if rng.random() < 0.7 else others)
                               for _ in range(rng.randint(1, length))] for length in (8, 12))
        expected = expected_text(tokenizer, prompt, completion)
        stop = []
        if expected and rng.random() < 0.5:
            start = rng.randrange(len(expected))
            stop = [expected[start:start + rng.randint(1, 3)]]
        cut = expected.find(stop[0]) if stop else -1
        text, stopped = (expected[:cut], stop[0]) if cut != -1 else (expected, None)
        assert generate(tokenizer, prompt, completion, stop) == (text, stopped, text), (prompt, completion)
        assert TextOffsets(tokenizer, prompt).take(completion) == expected_offsets(tokenizer, prompt, completion)
