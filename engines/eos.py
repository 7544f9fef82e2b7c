"""The token ids that end generation, as a Hugging Face checkpoint names them (both engine builders record them)."""

from __future__ import annotations

from typing import Any


def generation_eos_ids(config: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    """The end-of-sequence ids of a checkpoint's ``config.json`` and ``generation_config.json`` (``{}`` when it has
    none), as transformers' ``generate`` takes them: generation_config.json's where it names some, else
    config.json's; one id or a list, without repeats."""
    value = generation.get("eos_token_id")
    value = config.get("eos_token_id") if value is None else value
    return list(dict.fromkeys(int(i) for i in ([value] if isinstance(value, int) else value or [])))
