"""Kiln: a Hugging Face checkpoint to a quantized, cached, served engine.

The installed package is ``kiln``; its layers are subpackages (``kiln.pipeline → kiln.calibration, kiln.engines →
kiln.runtime``, docs/architecture.md). The runtime's public names are re-exported here and load on first use, so
``import kiln`` stays as light as ``import kiln.runtime``::

    from kiln import LLM, SamplingParams

    llm = LLM.load("/path/to/engine")
    print(llm.generate("Once upon a time", SamplingParams(max_tokens=16))[0].text)
"""

from __future__ import annotations

from kiln import runtime
from kiln.runtime import __all__  # the runtime's public names, reached from kiln itself (imported when first used)


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(runtime, name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
