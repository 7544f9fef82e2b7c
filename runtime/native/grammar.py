"""The native engine's structured output: an llguidance matcher per constrained request, and each step's token
bitmask for the constrained rows, computed on the host (in parallel, by llguidance's threads) and applied on the
device; the other rows of the batch are not touched.

A constrained request's next mask needs its last token. A step queued ahead (overlapped steps) while that token is
still on the device runs its model at once and samples once the host has read the token
(``ModelRunner.sample``): the device computes the next step's forward while the host postprocesses the current
step and fills the mask, and every request, constrained or not, gets a token every step.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np
import torch

from kiln.runtime.native.device_copy import device_tensor
from kiln.runtime.structured_output import StructuredOutput, StructuredOutputError
from kiln.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance


class Grammars:
    """Matchers for one engine's tokenizer and vocabulary (``eos_token_ids`` end a completed format)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)

    @functools.cached_property
    def _llg(self) -> tuple[llguidance.LLTokenizer, llguidance.LLExecutor]:
        """llguidance's view of the vocabulary (built on first use: ~0.5 s for 128k tokens) and its thread pool."""
        import llguidance

        if self.tokenizer is None:
            raise StructuredOutputError("structured output needs the engine's tokenizer, and it has no tokenizer.json")
        try:
            tokenizer = llguidance.LLTokenizer(self.tokenizer.to_dict()["tokenizer_json"], n_vocab=self.vocab_size,
                                               eos_token=self.eos_token_ids)
        except ValueError as exc:  # e.g. a tokenizer.json without a decoder: its tokens' bytes are unknown
            raise StructuredOutputError(f"structured output cannot use this engine's tokenizer.json: {exc}") from None
        misread = [token_id for token_id in self.tokenizer.added_text_ids
                   if token_id < self.vocab_size and tokenizer.is_special_token(token_id)]
        if misread:
            tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TextTokens(tokenizer, misread)),
                                               n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return tokenizer, llguidance.LLExecutor()

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher of ``spec``'s format; StructuredOutputError when it cannot run on this engine."""
        import llguidance

        matcher = llguidance.LLMatcher(self._llg[0], spec.llguidance_grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"the structured output format cannot be used: {matcher.get_error()}")
        return matcher

    def bitmask(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """The allowed next tokens of each matcher, one int32 row of ``ceil(vocab / 32)`` words each (bit ``t % 32``
        of word ``t // 32`` set when token ``t`` is allowed)."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

        bitmask = allocate_token_bitmask(len(matchers), self.vocab_size)
        fill_next_token_bitmask_par(self._llg[1], [(m, i) for i, m in enumerate(matchers)], bitmask)
        return bitmask


class _TextTokens:
    """llguidance's reading of a tokenizer.json (``read``: each token's bytes, its tokenization), with the added
    tokens it takes as special though tokenizer.json marks them ``special: false`` (``text_ids``) as text. It takes
    every added token spelt ``<...>`` as special (guidance-ai/llguidance#363), so a format could not spell out
    Qwen's ``<tool_call>`` or ``<think>``: the one token that text tokenizes to then failed the format."""

    def __init__(self, read: llguidance.LLTokenizer, text_ids: list[int]) -> None:
        self._read = read
        self.tokens = [read.decode_bytes([token_id]) for token_id in range(read.vocab_size)]
        self.special_token_ids = sorted(set(filter(read.is_special_token, range(read.vocab_size))) - set(text_ids))
        self.eos_token_id = read.eos_token
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        """The token ids of ``text``, as llguidance's reading of tokenizer.json tokenizes it."""
        return self._read.tokenize_str(text)


def advance_matcher(matcher: llguidance.LLMatcher, token_id: int, request_id: str, generated: int) -> None:
    """Advance a request's matcher by its sampled token (``generated`` tokens came before it); StructuredOutputError
    when the format cannot go on: it admits no output at all (``{"$ref": "#"}``: llguidance errs computing the first
    mask and allows only EOS), or it outgrew what llguidance can track (``a{1000}{1000}``)."""
    if matcher.consume_token(token_id) and not matcher.is_error():
        return
    why = (matcher.get_error() or "no reason given").splitlines()[0][:200]
    raise StructuredOutputError(f"request {request_id}: the structured output format cannot go on after {generated} "
                                f"tokens ({why}): no output satisfies it, or it outgrew what llguidance can track; "
                                "check and simplify the format")


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """Set to -inf, in place, the logits of ``rows`` whose tokens their row of ``bitmask`` does not allow."""
    device, vocab = logits.device, logits.shape[-1]
    words = device_tensor(bitmask, torch.int32, device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = device_tensor(rows, torch.long, device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
