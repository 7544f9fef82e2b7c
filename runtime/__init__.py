"""Kiln's embeddable runtime: `from runtime import LLM, SamplingParams`.

The public names load on first use, so `import runtime` (or a light submodule such as `runtime.cache_layout`) does
not pull in torch or the model code.
"""

from __future__ import annotations

import importlib

from runtime.errors import KilnError

__all__ = ["LLM", "KilnError", "RequestOutput", "SamplingParams", "StreamDelta"]

_LAZY = {"LLM": "runtime.llm", "RequestOutput": "runtime.outputs", "SamplingParams": "runtime.sampling_params",
         "StreamDelta": "runtime.outputs"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
