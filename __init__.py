"""Kiln: a Hugging Face checkpoint to a quantized, cached, served engine.

The installed package is ``kiln``; its layers are subpackages (``kiln.pipeline → kiln.calibration, kiln.engines →
kiln.runtime``, docs/architecture.md). The runtime's public names are re-exported here and load on first use, so
``import kiln`` stays as light as ``import kiln.runtime``::

    from kiln import LLM, SamplingParams

    llm = LLM.load("/path/to/engine")
    print(llm.generate("Once upon a time", SamplingParams(max_tokens=16))[0].text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln import runtime
from kiln.runtime import __all__  # the runtime's public names, reached from kiln itself (imported when first used)

if TYPE_CHECKING:  # what type checkers see of them
    from kiln.runtime import *  # noqa: F403
else:  # a module __getattr__ that type checkers saw would let them take any name, a misspelt one too

    def __getattr__(name: str) -> object:
        if name in __all__:
            return getattr(runtime, name)
        if name == "__version__":  # the installed distribution's, as `kiln --version` prints it
            from kiln.runtime.version import kiln_version

            return kiln_version() or "unknown"  # unknown: a checkout never installed
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")

    def __dir__() -> list[str]:  # tab completion and help() list the runtime's names too
        return sorted({*__all__, "__version__", "runtime", *(name for name in globals() if name.startswith("__"))})
