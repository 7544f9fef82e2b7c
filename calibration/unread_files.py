"""What calibration never reads of a model folder, so that the quantized checkpoint's key can leave it out: it
tokenizes plain text, so the chat templates and the generation config change nothing it computes."""

from __future__ import annotations

UNREAD_FILES = ("generation_config.json", "chat_template.json")
UNREAD_SUFFIXES = (".jinja",)  # chat_template.jinja and additional_chat_templates/*.jinja
TOKENIZER_CONFIG = "tokenizer_config.json"
UNREAD_TOKENIZER_CONFIG_KEYS = frozenset({"chat_template"})


def calibration_reads(rel: str) -> bool:
    """Whether calibration reads the model folder's file ``rel`` (its path relative to the folder); of
    TOKENIZER_CONFIG, it reads all but UNREAD_TOKENIZER_CONFIG_KEYS."""
    return rel not in UNREAD_FILES and not rel.endswith(UNREAD_SUFFIXES)
