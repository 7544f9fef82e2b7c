"""Another library's names on Kiln's objects (vLLM's on ``LLM``, transformers' on ``Tokenizer``): an
AttributeError that says what to use instead."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def hinted_attribute(obj: object, name: str, hints: Mapping[str, str], aside: str = "") -> Any:
    """``obj``'s attribute ``name`` as Python finds it (its own error for a name it lacks); for a name of ``hints``,
    an AttributeError saying what to use instead (``aside``: what ``obj`` is not)."""
    if name not in hints:
        return object.__getattribute__(obj, name)  # raises Python's error, or a property's own again
    raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}{aside}: {hints[name]}",
                         name=name, obj=obj)
