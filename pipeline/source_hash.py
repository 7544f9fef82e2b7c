"""Hashes of Kiln's own source files, in the cache keys: an engine or a quantized checkpoint that another revision of
Kiln made (another release, or a checkout between two) is never taken for this one's, however its version reads, as
torch's and Triton's caches key what they compile by a hash of their own sources."""

from __future__ import annotations

import ast
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import kiln

KILN_ROOT = Path(kiln.__file__).resolve().parent


@dataclass(frozen=True)
class BuildSources:
    """The code that decides what a stage writes: the modules of ``roots`` and every Kiln module they import,
    transitively (read statically, imports inside functions too), but those under ``excluded``; and ``files``,
    taken as they are (the build stage's own modules, whose imports reach far beyond the build)."""

    roots: tuple[str, ...]
    files: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ("engines/cache/",)  # where an engine is stored puts no byte into it


BUILD_STAGE = ("pipeline/config.py", "pipeline/stages.py", "pipeline/key_material.py", "pipeline/tokenizer_files.py")
# Where an engine is stored, and the request-time tokenizer, which a builder loads only to refuse a tokenizer.json
# that does not load (what a build copies is runtime/tokenizer_files.py): a change to its detokenizer or the sampling
# settings it reads rebuilds no engine
NOT_IN_ENGINES = ("engines/cache/", "runtime/tokenizer.py")
ENGINE_SOURCES = {"native": BuildSources(("kiln.engines.native.builder",), BUILD_STAGE, NOT_IN_ENGINES),
                  "trtllm": BuildSources(("kiln.engines.trtllm.builder",), BUILD_STAGE, NOT_IN_ENGINES)}
QUANTIZED_SOURCES = BuildSources(("kiln.calibration.quantize",))


def source_files(root: Path, sources: BuildSources) -> list[str]:
    """The files ``sources`` names under ``root`` (a package laid out as ``kiln``), relative to it, sorted."""
    found, modules = set(sources.files), list(sources.roots)
    seen: set[str] = set()
    while modules:
        name = modules.pop()
        if name in seen or (rel := _module_file(root, name)) is None or rel.startswith(sources.excluded):
            continue
        seen.add(name)
        found.add(rel)
        for node in ast.walk(ast.parse((root / rel).read_bytes())):
            if isinstance(node, ast.Import):
                modules += [alias.name for alias in node.names if alias.name.startswith("kiln.")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kiln."):
                modules += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return sorted(found)


def _module_file(root: Path, module: str) -> str | None:
    """The file of Kiln module ``module`` relative to ``root``; None for a name that is no module (a class)."""
    parts = module.split(".")[1:]
    for rel in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
        if (root / rel).is_file():
            return rel
    return None


def source_hash(root: Path, sources: BuildSources) -> str:
    """sha256 over the (path, content sha256) of ``source_files``."""
    digest = hashlib.sha256()
    for rel in source_files(root, sources):
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
