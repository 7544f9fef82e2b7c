"""Kiln's embeddable runtime: `from kiln.runtime import LLM, SamplingParams` (or `from kiln import ...`).

The public names load on first use, so `import kiln.runtime` (or a light submodule such as `kiln.runtime.errors`)
does not pull in torch or the model code.
"""

from __future__ import annotations

import importlib

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

__all__ = ["LLM", "CacheCorruptError", "CacheEntryGoneError", "DeviceUnavailableError", "EngineClosedError",
           "EngineFormatError", "EngineProcessError", "FingerprintMismatchError", "InsufficientKVMemoryError",
           "InvalidRequestError", "KilnError", "NoTokenAllowedError", "RequestFailedError", "RequestOutput",
           "RequestTooLongError", "RuntimeOptions", "RuntimeOptionsError", "SamplingError", "SamplingParams",
           "StreamDelta", "StructuredOutput", "StructuredOutputError", "TensorParallelError", "TokenLogprob",
           "TrtllmUnavailableError"]

_LAZY = {"CacheCorruptError": "kiln.runtime.cache_hold", "CacheEntryGoneError": "kiln.runtime.cache_hold",
         "RuntimeOptionsError": "kiln.runtime.options",
         "LLM": "kiln.runtime.llm", "RequestOutput": "kiln.runtime.outputs",
         "RequestFailedError": "kiln.runtime.outputs", "RequestTooLongError": "kiln.runtime.limits",
         "RuntimeOptions": "kiln.runtime.options", "SamplingParams": "kiln.runtime.sampling_params",
         "StreamDelta": "kiln.runtime.outputs", "StructuredOutput": "kiln.runtime.structured_output",
         "StructuredOutputError": "kiln.runtime.structured_output", "TokenLogprob": "kiln.runtime.outputs"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kiln.runtime' has no attribute {name!r}")
