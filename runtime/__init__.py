"""Kiln's embeddable runtime: `from kiln.runtime import LLM, SamplingParams` (or `from kiln import ...`).

The public names load on first use, so `import kiln.runtime` (or a light submodule such as `kiln.runtime.errors`)
does not pull in torch or the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kiln.runtime.errors import (
    DeviceUnavailableError,
    EngineClosedError,
    EngineFormatError,
    EngineProcessError,
    FingerprintMismatchError,
    InsufficientKVMemoryError,
    InvalidRequestError,
    KilnError,
    NoTokenAllowedError,
    SamplingError,
    TensorParallelError,
    TrtllmUnavailableError,
)

__all__ = ["LLM", "CacheCorruptError", "CacheEntryGoneError", "ChatInputError", "CompletionOutput",
           "DeviceUnavailableError", "EngineClosedError", "EngineFormatError", "EngineLimits", "EngineProcessError",
           "FingerprintMismatchError", "InsufficientKVMemoryError", "InvalidRequestError", "KilnError",
           "NoTokenAllowedError", "Prompt", "RequestFailedError", "RequestMetrics", "RequestOutput",
           "RequestTooLongError", "RuntimeOptions", "RuntimeOptionsError", "SamplingError", "SamplingParams",
           "StreamDelta", "StructuredOutput", "StructuredOutputError", "TensorParallelError", "TokenLogprob",
           "Tokenizer", "TrtllmUnavailableError"]

_LAZY = {"CacheCorruptError": "kiln.runtime.cache_hold", "CacheEntryGoneError": "kiln.runtime.cache_hold",
         "ChatInputError": "kiln.runtime.conversations", "CompletionOutput": "kiln.runtime.outputs",
         "EngineLimits": "kiln.runtime.limits", "RuntimeOptionsError": "kiln.runtime.options",
         "LLM": "kiln.runtime.llm", "Prompt": "kiln.runtime.llm", "RequestOutput": "kiln.runtime.outputs",
         "RequestFailedError": "kiln.runtime.outputs", "RequestMetrics": "kiln.runtime.outputs",
         "RequestTooLongError": "kiln.runtime.limits", "RuntimeOptions": "kiln.runtime.options",
         "SamplingParams": "kiln.runtime.sampling_params", "StreamDelta": "kiln.runtime.outputs",
         "StructuredOutput": "kiln.runtime.structured_output",
         "StructuredOutputError": "kiln.runtime.structured_output", "TokenLogprob": "kiln.runtime.outputs",
         "Tokenizer": "kiln.runtime.tokenizer"}

if TYPE_CHECKING:  # what type checkers see of the names loaded on first use
    from kiln.runtime.cache_hold import CacheCorruptError, CacheEntryGoneError
    from kiln.runtime.conversations import ChatInputError
    from kiln.runtime.limits import EngineLimits, RequestTooLongError
    from kiln.runtime.llm import LLM, Prompt
    from kiln.runtime.options import RuntimeOptions, RuntimeOptionsError
    from kiln.runtime.outputs import (
        CompletionOutput,
        RequestFailedError,
        RequestMetrics,
        RequestOutput,
        StreamDelta,
        TokenLogprob,
    )
    from kiln.runtime.sampling_params import SamplingParams
    from kiln.runtime.structured_output import StructuredOutput, StructuredOutputError
    from kiln.runtime.tokenizer import Tokenizer
else:  # a module __getattr__ that type checkers saw would let them take any name, a misspelt one too

    def __getattr__(name: str) -> object:
        if name in _LAZY:
            return getattr(importlib.import_module(_LAZY[name]), name)
        raise AttributeError(f"module 'kiln.runtime' has no attribute {name!r}")

    def __dir__() -> list[str]:  # tab completion and help() list the names loaded on first use too
        return sorted({*globals(), *__all__})
