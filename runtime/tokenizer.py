"""Text in and out: a `tokenizers.Tokenizer` wrapper, incremental detokenization and stop strings."""

from __future__ import annotations

import codecs
import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

from kiln.runtime.attribute_hints import hinted_attribute
from kiln.runtime.errors import EngineFormatError, InvalidRequestError
from kiln.runtime.json_files import read_json_object
from kiln.runtime.sampling_params import SamplingParams, plain_number

logger = logging.getLogger("kiln.runtime")

# Prompt tokens kept as context when decoding the first completion tokens (spaces and merged bytes depend on it).
_CONTEXT_TOKENS = 6
# Texts longer than this are encoded through ``encode_batch``, which releases the GIL (``encode`` holds it).
GIL_FREE_ENCODE_CHARS = 1 << 16


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters (GPT-2's ``bytes_to_unicode``) to the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_alphabet()


# the texts of an engine's special tokens by role (bos_token, eos_token, ...), for the hints below
SPECIAL_TOKEN_TEXTS = "kiln.runtime.tokenizer_files.special_token_texts(llm.engine_dir)"
# transformers' tokenizer methods and attributes vLLM scripts use on get_tokenizer(), and what Kiln's Tokenizer has
# instead
TRANSFORMERS_METHODS = {
    "apply_chat_template": "llm.chat renders and generates; to render alone, "
                           "kiln.runtime.chat_template.ChatTemplate.from_dir(ENGINE_DIR).render(messages)",
    "batch_decode": "decode each: [tokenizer.decode(ids) for ids in batch]",
    "batch_encode_plus": "encode each: [tokenizer.encode(text) for text in texts]",
    "convert_ids_to_tokens": "use tokenizer.vocabulary_entries(ids)",
    "convert_tokens_to_ids": "use tokenizer.token_id(token), one token at a time",
    "get_vocab": "use tokenizer.vocab_size and tokenizer.vocabulary_entries(ids)",
    **{f"{role}_token": f"Kiln's Tokenizer holds no special-token roles: {SPECIAL_TOKEN_TEXTS}['{role}_token'] is "
                        f"its text" for role in ("bos", "eos", "pad")},
    **{f"{role}_token_id": f"Kiln's Tokenizer holds no special-token roles (nor does LLM): "
                           f"tokenizer.token_id({SPECIAL_TOKEN_TEXTS}['{role}_token']) is its id{why}"
       for role, why in (("bos", "; encode(text) adds BOS where the checkpoint's tokenizer does"),
                         ("eos", "; generation stops at the engine's EOS ids by itself (unless "
                                 "SamplingParams.ignore_eos)"),
                         ("pad", "; Kiln pads nothing, each prompt runs at its own length"))},
}
NOT_TRANSFORMERS = " (it is no transformers tokenizer)"
# what calling a transformers tokenizer (``tokenizer(text)``) is in Kiln's
ENCODE_INSTEAD = "use tokenizer.encode(text) for the token ids (transformers' tokenizer(text)['input_ids'])"


class Tokenizer:
    """Encodes prompts as the checkpoint's own tokenizer does (including BOS) and decodes token ids."""

    if not TYPE_CHECKING:  # type checkers keep catching a misspelt attribute

        def __getattr__(self, name: str) -> Any:
            """Only for a name the Tokenizer lacks: transformers' name of something it has under another says so."""
            return hinted_attribute(self, name, TRANSFORMERS_METHODS, NOT_TRANSFORMERS)

        def __call__(self, *args: object, **kwargs: object) -> Any:
            """transformers' ``tokenizer(text)``: refused, saying what to call."""
            raise TypeError(f"'Tokenizer' object is not callable{NOT_TRANSFORMERS}: {ENCODE_INSTEAD}")

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, directory: Path) -> Tokenizer | None:
        """Load `tokenizer.json` from an engine or checkpoint directory; None when it has no tokenizer (its prompts
        are then token ids). EngineFormatError names a file that does not load (`tokenizer_config.json` too).
        Special tokens such as BOS are added by the post-processor alone, as transformers 5 does:
        `tokenizer_config.json`'s `add_bos_token` changes nothing."""
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            return None
        try:  # from_str: from_file takes only a path that is valid UTF-8
            tokenizer = tokenizers.Tokenizer.from_str(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise EngineFormatError(f"{path}: unreadable ({e.strerror}); make it readable") from None
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise EngineFormatError(f"{path}: not a tokenizer the tokenizers library loads ({e}); save the "
                                    "tokenizer again with save_pretrained") from None
        config_path = Path(directory) / "tokenizer_config.json"  # the chat template's special tokens come from it
        config = read_json_object(config_path, EngineFormatError, "save the tokenizer again") \
            if config_path.is_file() else {}
        if config.get("add_bos_token") is True and 1 not in tokenizer.encode("a").special_tokens_mask:
            logger.warning("%s says add_bos_token but tokenizer.json's post-processor adds no BOS: prompts are "
                           "encoded without one, as transformers 5 encodes them (Kiln before 2026-12-06 added it)",
                           config_path)
        return cls(tokenizer)

    def token_id(self, text: str) -> int | None:
        """The id of the token ``text`` is (a special token's, say), or None."""
        return self._tokenizer.token_to_id(text)

    def is_special(self, text: str) -> bool:
        """Whether ``text`` is one special token (one that ``skip_special_tokens`` leaves out of decoded text)."""
        return self.token_id(text) in self._special_ids

    def to_dict(self) -> dict:
        """The tokenizer as JSON-serializable data (what `from_dict` takes), to hand it to another process."""
        return {"tokenizer_json": self._tokenizer.to_str()}

    @classmethod
    def from_dict(cls, data: dict) -> Tokenizer:
        """The tokenizer `to_dict` described."""
        return cls(tokenizers.Tokenizer.from_str(data["tokenizer_json"]))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens its post-processor adds (BOS) unless `add_special_tokens` is
        False, as for a rendered chat template that writes them itself. Special tokens written in `text` are always
        parsed."""
        check_unicode(text)
        if len(text) > GIL_FREE_ENCODE_CHARS:  # encode_batch lets other threads run while it works
            ids = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def char_offsets(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Where each token of ``encode(text, add_special_tokens)`` starts in ``text`` (a special token the
        post-processor adds at 0; the pieces of one character at that character)."""
        return [start for start, _ in self._tokenizer.encode(text, add_special_tokens=add_special_tokens).offsets]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``, without special tokens unless ``skip_special_tokens`` is False."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def text_bytes(self, token_ids: list[int], skip_special_tokens: bool = True) -> bytes:
        """The bytes ``decode`` makes its text of: each token's ``token_bytes``, none for a skipped special token or
        an id outside the vocabulary (the model's may be larger)."""
        skipped = self._special_ids if skip_special_tokens else frozenset()
        return b"".join(self.token_bytes(token_id) for token_id in token_ids if token_id not in skipped)

    def vocabulary_entries(self, token_ids: list[int]) -> list[str]:
        """Each token as its vocabulary spells it (``Ġthe``, ``▁the``), as transformers' ``convert_ids_to_tokens``."""
        return [self._tokenizer.id_to_token(token_id) or "" for token_id in token_ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a multi-byte character is a valid answer), as OpenAI's
        ``logprobs`` report them: a special token's own text; a byte-level BPE token through the byte alphabet (one
        with a character outside it, an added token such as ``‹｜User｜>``, as its own text, as the decoder reads it);
        a SentencePiece token with its ``▁`` as a space and ``<0xNN>`` as that byte; else the token decoded alone.
        No bytes for an id past the tokenizer's vocabulary (a model's rows of padding), which decodes to no
        text."""
        if (cached := self._token_bytes.get(token_id)) is not None:
            return cached
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special_ids:
            value = piece.encode()
        elif self._byte_level:
            value = (bytes(_BYTE_OF_CHAR[char] for char in piece) if all(char in _BYTE_OF_CHAR for char in piece)
                     else piece.encode())
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            value = bytes([int(piece[3:5], 16)])
        elif "\u2581" in piece:
            value = piece.replace("\u2581", " ").encode()
        else:
            value = self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
        self._token_bytes[token_id] = value
        return value

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token stands for: a text of more than ``n * max_token_bytes`` characters has more
        than ``n`` tokens, which bounds a prompt's length before tokenizing it."""
        return max(len(self.token_bytes(token_id)) for token_id in range(self.vocab_size))

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest id the tokenizer makes: its vocabulary's last or an added token's (a model whose vocabulary
        is smaller cannot take it)."""
        added = self._tokenizer.get_added_tokens_decoder()
        return max(self._tokenizer.get_vocab_size(with_added_tokens=False) - 1, *added, -1)

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether tokens are byte-level BPE pieces: a ByteLevel decoder, alone or as all of a Sequence (LFM2's)."""
        decoder = self._tokenizer.decoder
        if isinstance(decoder, tokenizers.decoders.ByteLevel):
            return True
        if not isinstance(decoder, tokenizers.decoders.Sequence):
            return False
        members = json.loads(decoder.__getstate__()).get("decoders") or []
        return bool(members) and all(member.get("type") == "ByteLevel" for member in members)

    @functools.cached_property
    def added_text_ids(self) -> frozenset[int]:
        """The added tokens tokenizer.json marks ``special: false`` (Qwen's ``<tool_call>`` and ``<think>``): one
        token each, but text that decoding keeps."""
        return frozenset(token_id for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
                         if not token.special)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(token_id for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
                         if token.special)


class IncrementalDetokenizer:
    """A request's completion text, grown one token at a time, cut before the first stop string.

    Each token decodes only a short window (vLLM's prefix/read offsets), so a step costs the same at token 10 and
    token 10,000; a token that ends inside a multi-byte character waits for the next one. A prompt that ends inside
    a character leaves it to the completion: its text starts with that character (U+FFFD where the completion does
    not finish it), as vLLM's does. While stop strings are set, the last `len(longest stop) - 1` characters are held
    back from streaming until they cannot start one. Stop strings are looked for once there are more than
    ``min_tokens`` completion tokens (as vLLM looks for them), ending in the whole characters those later tokens
    complete: one is found at the token that completes its last character, though that token starts another, and
    the ``max_tokens``-th token searches the text as the completion ends (U+FFFD for a character it leaves
    unfinished). Special tokens add no text unless ``skip_special_tokens`` is False. With ``include_stop``, what
    stopped the completion stays at the end of the text: the stop string (the text after it is cut) or the stop
    token's text. Where a byte-fallback tokenizer's bytes turn invalid after whole characters, those characters stay
    and the bytes after them read as ``decode`` reads them alone (``decode`` of the whole run writes U+FFFD for every
    byte of it).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str], min_tokens: int = 0,
                 skip_special_tokens: bool = True, include_stop: bool = False, max_tokens: int | None = None) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._tokens = self._context(list(prompt_token_ids))
        self._prefix_offset = 0
        # the tokens of the prompt's unfinished last character are read again, with the whole characters of the
        # first of them (the prompt's, not the completion's)
        self._read_offset, lead, _ = self._unfinished_character(self._tokens)
        self._prompt_chars = len(self._text_before(self._read_offset, lead)) if lead else 0
        self._stop = stop
        self._include_stop = include_stop
        # the tail that could begin a stop string is held back, unless a stop string is kept (nothing sent is cut)
        self._hold = 0 if include_stop else max((len(s) for s in stop), default=1) - 1
        self._stop_from_token = min_tokens  # completion tokens up to which no stop string ends the text
        self._max_tokens = max_tokens  # at the last token, an unfinished character's U+FFFD is text to search too
        self._num_tokens = 0
        self._num_searched_chars = 0  # characters of text and whole pending text no new stop string may end in
        self._num_streamed_chars = 0
        self.text = ""

    def add_token(self, token_id: int) -> str | None:
        """Append a token's text; return the stop string it completed (the text then ends before it), else None."""
        self._tokens.append(token_id)
        self._num_tokens += 1
        if not self._stop:  # nothing to search: the text grows once its characters are whole (a third cheaper)
            if (pending := self._pending_text()) and not pending.endswith("\ufffd"):
                self._take_pending(pending)
            return None
        if self._num_tokens == self._max_tokens:  # the last token: its text is what the final take_delta writes
            pending, final = self._pending_text(), True
        else:  # in whole characters; a byte-fallback run's U+FFFD may still change
            pending, final = self._whole_pending_text()
            final = final and not pending.endswith("\ufffd")
        if pending and final:
            self._take_pending(pending)
            pending = ""
        searched, text = self._num_searched_chars, self.text + pending
        self._num_searched_chars = len(text)
        if self._num_tokens <= self._stop_from_token:
            return None
        # a match must end in the new text: what came before was searched already, or came before min_tokens
        matches = [(i, s) for s in self._stop if (i := text.find(s, max(0, searched - len(s) + 1))) != -1]
        if not matches:
            return None
        self._take_pending(pending)  # the characters after the stop string are dropped, an unfinished one too
        index, stop = min(matches)
        self.text = text[:index + len(stop) if self._include_stop else index]
        return stop

    def end_with_stop_token(self, token_id: int) -> None:
        """The stop token (EOS or a ``stop_token_ids`` one) that ended the completion: its text joins the text, at the
        final ``take_delta``, where the request keeps what stopped it (``include_stop``)."""
        if self._include_stop:
            self._tokens.append(token_id)
            self._num_tokens += 1

    def take_delta(self, finished: bool) -> str:
        """Text not streamed yet; before the end, minus the tail that could still begin a stop string. At the end,
        tokens still waiting for the rest of a multi-byte character count as they decode (U+FFFD for the
        incomplete bytes, as vLLM returns them): no token's bytes are dropped."""
        if finished:
            self._take_pending(self._pending_text())
        end = len(self.text) if finished else max(self._num_streamed_chars, len(self.text) - self._hold)
        delta = self.text[self._num_streamed_chars:end]
        self._num_streamed_chars = end
        return delta

    def characters_before(self, next_token_id: int) -> int:
        """Characters the tokens not taken into ``text`` yet decode to before the one ``next_token_id`` starts or
        completes: an unfinished character that the next token does not continue counts as it decodes (U+FFFD), as
        does every invalid byte."""
        pending = self._tokens[self._read_offset:]
        if not pending:
            return 0
        start, lead, unfinished = self._unfinished_character(pending)
        next_byte = self._tokenizer.text_bytes([next_token_id], self._skip_special_tokens)[:1]
        if _continues(unfinished, next_byte):
            before = len(self._text_before(self._read_offset + start, lead))
        else:
            before = len(self._text_after_read(len(self._tokens)))
        return max(0, before - self._prompt_chars)

    def _context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last ``_CONTEXT_TOKENS``, and up to 3 more before them while they begin inside a character
        (a byte-fallback run decoded from its middle reads U+FFFD throughout)."""
        start = max(0, len(prompt_token_ids) - _CONTEXT_TOKENS)
        for _ in range(3):
            first = self._tokenizer.text_bytes(prompt_token_ids[start:start + 1], self._skip_special_tokens)
            if start == 0 or not first or not 0x80 <= first[0] < 0xC0:  # not a UTF-8 continuation byte
                break
            start -= 1
        return prompt_token_ids[start:]

    def _unfinished_character(self, token_ids: list[int]) -> tuple[int, bool, bytes]:
        """The character whose first bytes end ``token_ids``: the index of the token it starts in (the length of
        ``token_ids`` when none is unfinished), whether that token has bytes before it, and its bytes."""
        token_bytes = [self._tokenizer.text_bytes([token_id], self._skip_special_tokens) for token_id in token_ids]
        joined = b"".join(token_bytes)
        unfinished = _unfinished_bytes(joined)  # at most 3 bytes, so 3 tokens
        start, covered = len(token_ids), 0
        while covered < len(unfinished):
            start -= 1
            covered += len(token_bytes[start])
        return start, covered > len(unfinished), unfinished

    def _text_before(self, start: int, lead: bool) -> str:
        """The text the tokens from the read offset add before the unfinished character that starts in token
        ``start`` (all of it at ``len(tokens)``). Where that token has bytes before it (``lead``: a byte-level BPE's),
        the text through the last token less the one U+FFFD the character reads as, so those bytes count as they
        decode after the tokens before them (the end of a character those began, a byte joining their U+FFFD); else
        the text of the tokens before ``start`` (a byte-fallback run ending in a character's first bytes decodes to
        U+FFFD throughout)."""
        if lead:
            return self._text_after_read(len(self._tokens))[:-1]
        return self._text_after_read(start)

    def _whole_pending_text(self) -> tuple[str, bool]:
        """The text the tokens after the read offset add in whole characters, and whether that is all of it (no
        character is left unfinished, for the next token to complete)."""
        start, lead, unfinished = self._unfinished_character(self._tokens[self._read_offset:])
        return self._text_before(self._read_offset + start, lead)[self._prompt_chars:], not unfinished

    def _pending_text(self) -> str:
        """The text the tokens after the read offset add (empty while they add none)."""
        return self._text_after_read(len(self._tokens))[self._prompt_chars:]

    def _text_after_read(self, end: int) -> str:
        """The text the tokens from the read offset to ``end`` add, decoded after the window before them; alone where
        the window's text changes with them (a byte-fallback run of whole characters that their bytes make invalid)."""
        skip, tokens = self._skip_special_tokens, self._tokens
        prefix_text = self._tokenizer.decode(tokens[self._prefix_offset:self._read_offset], skip)
        new_text = self._tokenizer.decode(tokens[self._prefix_offset:end], skip)
        if not new_text.startswith(prefix_text):
            return self._tokenizer.decode(tokens[self._read_offset:end], skip)
        return new_text[len(prefix_text):]

    def _take_pending(self, text: str) -> None:
        """Append ``text``, the pending tokens' (``_pending_text``), and move the offsets past them."""
        self.text += text
        self._prompt_chars = 0
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)


def _unfinished_bytes(data: bytes) -> bytes:
    """The first bytes of a character that end ``data``, which more bytes may complete (none where none do)."""
    rest = data[codecs.utf_8_decode(data, "replace", False)[1]:]
    # the incremental decoder also holds back ED A0..BF, a UTF-16 surrogate's first bytes, which no byte completes
    return b"" if rest[:1] == b"\xed" and rest[1:2] >= b"\xa0" else rest


def _continues(unfinished: bytes, next_byte: bytes) -> bool:
    """Whether ``next_byte`` (none: it may yet) continues the character whose first bytes are ``unfinished``."""
    joined = unfinished + next_byte
    try:
        joined.decode("utf-8")  # completes it
    except UnicodeDecodeError:
        return _unfinished_bytes(joined) == joined
    return True


def check_unicode(text: str) -> None:
    """Raise InvalidRequestError when ``text`` is not valid Unicode (a lone UTF-16 surrogate, which a JSON escape
    such as ``\\ud800`` can carry): no tokenizer can encode it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"the text holds a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at "
                                  f"character {exc.start}: send valid Unicode") from None


def request_detokenizer(tokenizer: Tokenizer | None, prompt_token_ids: list[int],
                        params: SamplingParams) -> IncrementalDetokenizer | None:
    """The detokenizer of a request's completion text; None without a tokenizer or when it asked for ids only."""
    if tokenizer is None or not params.detokenize:
        return None
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop, params.min_tokens,
                                  params.skip_special_tokens, params.include_stop_str_in_output, params.max_tokens)


def encode_prompt(prompt: str | list[int], tokenizer: Tokenizer | None, vocab_size: int, has_stop_strings: bool,
                  error: type[InvalidRequestError] = InvalidRequestError) -> list[int]:
    """A prompt's token ids: text through the tokenizer, or ids checked against the vocabulary (either given bare, or
    as vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``, the ids winning where a vLLM TokensPrompt also
    carries its text); raises ``error``."""
    if isinstance(prompt, dict):
        if not prompt or not prompt.keys() <= {"prompt", "prompt_token_ids"}:
            raise error(f"a prompt given as a dict holds vLLM's 'prompt' (text) or 'prompt_token_ids' (token ids, "
                        f"with their 'prompt' text or without): Kiln takes none of vLLM's other prompt keys "
                        f"(cache_salt, multi_modal_data, ...); got {sorted(map(str, prompt))}")
        prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise error("this engine has no tokenizer.json: pass the prompt as token ids")
        token_ids = tokenizer.encode(prompt)
        if tokenizer.max_token_id >= vocab_size and token_ids and (largest := max(token_ids)) >= vocab_size:
            # an embedding failure would stop the engine; a tokenizer that matches its model makes no such id
            raise error(_unmatched_tokenizer(largest, vocab_size))
    elif isinstance(prompt, list | tuple):
        token_ids = [plain_number(t) for t in prompt]  # NumPy's and torch's integers too
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad and tokenizer is not None and all(isinstance(t, int) and vocab_size <= t <= tokenizer.max_token_id
                                                 for t in bad):  # what the tokenizer made (a chat's rendered text)
            raise error(_unmatched_tokenizer(bad[0], vocab_size))
        if bad:
            raise error(f"prompt token ids {bad[:5]} are not ints in [0, {vocab_size}): tokenize with this engine's "
                        "tokenizer")
    else:
        raise error(f"a prompt is text (a str) or token ids (a list of ints), bare or in vLLM's dict of either, got "
                    f"{type(prompt).__name__}")
    if has_stop_strings and tokenizer is None:
        raise error("stop strings need a tokenizer and this engine has no tokenizer.json: use stop_token_ids")
    return token_ids


def _unmatched_tokenizer(token_id: int, vocab_size: int) -> str:
    """Why a prompt holding ``token_id``, which the engine's tokenizer makes, is refused."""
    return (f"this engine's tokenizer makes token id {token_id}, outside the model's vocabulary [0, {vocab_size}): "
            f"the tokenizer does not match the model; rebuild the engine with the model's own tokenizer")
