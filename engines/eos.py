"""The token ids that end generation, as a Hugging Face checkpoint names them (both engine builders record them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.runtime.tokenizer import Tokenizer
from kiln.runtime.tokenizer_files import eos_token_text


def declared_eos(config: dict[str, Any], generation: dict[str, Any]) -> tuple[str, Any]:
    """Which file of a checkpoint names its end-of-sequence ids, and its ``eos_token_id`` as written, as
    transformers' ``generate`` takes them: generation_config.json's where it names some, else config.json's."""
    value = generation.get("eos_token_id")
    return ("config.json", config.get("eos_token_id")) if value is None else ("generation_config.json", value)


def generation_eos_ids(config: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    """The end-of-sequence ids of a checkpoint's ``config.json`` and ``generation_config.json`` (``{}`` when it has
    none), from the file ``declared_eos`` names: one id or a list, without repeats."""
    value = declared_eos(config, generation)[1]
    return list(dict.fromkeys(int(i) for i in ([value] if isinstance(value, int) else value or [])))


def stopping_eos_ids(checkpoint_dir: Path, config: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    """``generation_eos_ids``, then the id of the tokenizer's ``eos_token`` where it is another, as vLLM stops on
    both (``eos_token_text``: as transformers reads it): a ChatML fine-tune may name ``<|im_end|>`` in
    tokenizer_config.json and only ``<|endoftext|>`` in its configs, and every chat reply would otherwise run to
    its token limit. A tokenizer's id past the model's ``vocab_size`` is left out: the model never emits it."""
    ids = generation_eos_ids(config, generation)
    text = eos_token_text(checkpoint_dir)
    tokenizer = Tokenizer.from_dir(checkpoint_dir) if text is not None else None
    token_id = None if tokenizer is None else tokenizer.token_id(text)
    vocab_size = config.get("vocab_size")
    outside = token_id is not None and isinstance(vocab_size, int) and token_id >= vocab_size
    return ids if token_id is None or token_id in ids or outside else [*ids, token_id]
