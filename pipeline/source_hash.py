"""Hashes of Kiln's own source files, in the cache keys: an engine or a quantized checkpoint that another revision of
Kiln made (another release, or a checkout between two) is never taken for this one's, however its version reads, as
torch's and Triton's caches key what they compile by a hash of their own sources."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import kiln

KILN_ROOT = Path(kiln.__file__).resolve().parent

# the code an engine is built (and its plan measured) with: the builders, the engine format and model code they
# write for, and the build stage's rewrite of tokenizer.json; not where an engine is stored or how it is served,
# which put no byte into it
ENGINE_SOURCES = ("engines", "runtime", "pipeline/tokenizer_files.py")
NOT_ENGINE_SOURCES = ("engines/cache", "runtime/server", "runtime/engine_process")
QUANTIZED_SOURCES = ("calibration",)


def source_hash(root: Path, folders: tuple[str, ...], excluded: tuple[str, ...] = ()) -> str:
    """sha256 over the sorted (path, content) of the ``*.py`` files under ``folders`` (or named) of ``root``, those
    under ``excluded`` left out."""
    paths = [path for folder in folders for path in ((root / folder).rglob("*.py") if (root / folder).is_dir()
                                                     else [root / folder])]
    files = sorted(path.relative_to(root).as_posix() for path in paths)
    digest = hashlib.sha256()
    for rel in files:
        if not any(rel.startswith(f"{skipped}/") for skipped in excluded):
            digest.update(f"{rel}\0{hashlib.sha256((root / rel).read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()


@functools.cache
def engine_sources_hash() -> str:
    """The hash of the Kiln code that builds engines (``ENGINE_SOURCES``)."""
    return source_hash(KILN_ROOT, ENGINE_SOURCES, NOT_ENGINE_SOURCES)


@functools.cache
def quantized_sources_hash() -> str:
    """The hash of the Kiln code that calibrates and exports quantized checkpoints (``QUANTIZED_SOURCES``)."""
    return source_hash(KILN_ROOT, QUANTIZED_SOURCES)
