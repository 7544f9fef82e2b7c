"""What a store's lookups and builds return: a ``LookupResult`` (hit, or why not) and a ``CacheResult`` (where the
entry is, and how it got there); and the keys of the rows ``kiln cache ls`` and ``verify`` report, local or remote."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln.engines.cache.in_use import EntryHold


@dataclass(frozen=True)
class LookupResult:
    """What a lookup found: ``reason`` is ``hit``, ``new``, ``evicted``, ``corrupt`` or ``incompatible``."""

    hit: bool
    reason: str
    entry_dir: Path
    detail: str = ""
    manifest: dict | None = None

    @property
    def build_seconds(self) -> float:
        """What building the entry took, as its manifest records it (0 without one)."""
        return recorded_build_seconds(self.manifest)


def recorded_build_seconds(manifest: dict | None) -> float:
    """The build time a manifest records (0 without one, or without a number there)."""
    value = (manifest or {}).get("build_seconds", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


@dataclass(frozen=True)
class CacheResult:
    """The outcome of ``get_or_build``: where the entry and its payload are, and how it got there."""

    key: str
    entry_dir: Path
    payload_dir: Path
    hit: bool
    reason: str
    build_seconds: float
    waited: bool
    replaced_in_use: bool = False  # a forced rebuild replaced an entry some process had loaded (it keeps the old)
    pulled: bool = False  # installed from the remote tier (``hit`` is then true: nothing was built)
    hold: EntryHold | None = field(default=None, compare=False, repr=False)  # ``pull(..., hold=True)``'s


# One key set per command, local and remote alike (docs/cache.md describes each key); a key that does not apply to a
# tier is None there: ``hits`` of a remote entry (a remote counts none), ``problem`` of a local entry (``kiln cache
# verify`` judges those).
LS_ROW_KEYS = ("key", "store", "model", "format", "kv_cache_dtype", "backend", "gpu", "size_bytes", "created",
               "last_used", "hits", "problem")
DESCRIBED = ("model", "format", "kv_cache_dtype", "backend", "gpu")  # a row's keys that its manifest's describe gives


def described(describe: dict) -> dict:
    """The ``DESCRIBED`` keys of a manifest's ``describe`` (None where an entry of an older Kiln lacks one)."""
    return {name: describe.get(name) for name in DESCRIBED}
VERIFY_ROW_KEYS = ("key", "store", "ok", "files_checked", "problems", "incompatible")


def uniform_rows(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """``rows`` with every one of ``keys``, in that order (None where a row lacks one), before any key of their own."""
    return [{**dict.fromkeys(keys), **row} for row in rows]
