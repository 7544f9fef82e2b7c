"""Hashes of Kiln's own source files, in the cache keys: an engine or a quantized checkpoint that another revision of
Kiln made (another release, or a checkout between two) is never taken for this one's, however its version reads, as
torch's and Triton's caches key what they compile by a hash of their own sources."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import kiln

KILN_ROOT = Path(kiln.__file__).resolve().parent

# the code that decides an engine's bytes, per backend: its builder and the engine format and model code it writes
# for, and the build stage's plan, options and tokenizer rewrite; not where an engine is stored or how it is served
BUILD_STAGE_SOURCES = ("engines/eos.py", "runtime/plan.py", "runtime/options.py", "runtime/tokenizer.py",
                       "pipeline/config.py", "pipeline/stages.py", "pipeline/key_material.py",
                       "pipeline/tokenizer_files.py")
ENGINE_SOURCES = {"native": ("engines/native", "runtime/native", *BUILD_STAGE_SOURCES),
                  "trtllm": ("engines/trtllm", "runtime/trtllm/engine_info.py", *BUILD_STAGE_SOURCES)}
QUANTIZED_SOURCES = ("calibration",)


def source_hash(root: Path, sources: tuple[str, ...]) -> str:
    """sha256 over the sorted (path, content) of the ``*.py`` files that ``sources`` name under ``root``: files, or
    folders (their ``*.py`` files at any depth, hidden folders left out)."""
    paths = [path for source in sources for path in ((root / source).rglob("*.py") if (root / source).is_dir()
                                                     else [root / source])]
    files = sorted({path.relative_to(root).as_posix() for path in paths})
    digest = hashlib.sha256()
    for rel in files:
        if not any(part.startswith(".") for part in rel.split("/")):
            digest.update(f"{rel}\0{hashlib.sha256((root / rel).read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()


@functools.cache
def engine_sources_hash(backend: str) -> str:
    """The hash of the Kiln code that builds ``backend``'s engines (``ENGINE_SOURCES``)."""
    return source_hash(KILN_ROOT, ENGINE_SOURCES[backend])


@functools.cache
def quantized_sources_hash() -> str:
    """The hash of the Kiln code that calibrates and exports quantized checkpoints (``QUANTIZED_SOURCES``)."""
    return source_hash(KILN_ROOT, QUANTIZED_SOURCES)
