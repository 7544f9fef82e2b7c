"""Streamed text that may end inside a tag (``<tool_call>``, ``</think>``): how much of its end to hold back until
the next piece shows whether the tag comes."""

from __future__ import annotations


def partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag`` (0 when none may); the tag whole is not counted."""
    return next((keep for keep in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-keep:])), 0)
