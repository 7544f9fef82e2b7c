"""Eviction: least recently used first (by recorded last use), down to a size and an entry-count bound.

An entry that a live process holds (see ``in_use``) is never removed; it is reported and skipped."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.engines.cache.in_use import is_held
from kiln.engines.cache.layout import LAST_USED
from kiln.engines.cache.manifest import entry_size, read_manifest
from kiln.engines.cache.store import ContentStore


@dataclass(frozen=True)
class EntryInfo:
    """One published entry as eviction and ``kiln cache ls`` see it."""

    store: str
    key: str
    entry_dir: Path
    size_bytes: int
    last_used: float
    created: str | None
    describe: dict


@dataclass
class EvictionReport:
    """What an eviction pass removed (or, dry, would remove), which entries it had to skip as in use, and the
    entries and bytes left."""

    removed: list[EntryInfo] = field(default_factory=list)
    in_use: list[EntryInfo] = field(default_factory=list)
    dry_run: bool = False
    remaining_entries: int = 0
    remaining_bytes: int = 0

    @property
    def freed_bytes(self) -> int:
        return sum(entry.size_bytes for entry in self.removed)


def entry_info(store: ContentStore, key: str) -> EntryInfo | None:
    """The entry's size, last use, creation time and display fields; None when it vanished meanwhile."""
    entry = store.entry_dir(key)
    try:
        last_used = os.stat(entry / LAST_USED).st_mtime
    except FileNotFoundError:
        try:
            last_used = os.stat(entry).st_mtime
        except FileNotFoundError:
            return None
    manifest = read_manifest(entry) or {}
    describe = manifest.get("describe") if isinstance(manifest.get("describe"), dict) else {}
    return EntryInfo(store.name, key, entry, entry_size(entry, manifest), last_used, manifest.get("created"), describe)


def list_entries(stores: Iterable[ContentStore]) -> list[EntryInfo]:
    """Every published entry of the given stores, least recently used first."""
    infos = [info for store in stores for key in store.list_keys() if (info := entry_info(store, key)) is not None]
    return sorted(infos, key=lambda e: (e.last_used, e.created or "", e.key))


def evict(stores: dict[str, ContentStore], *, max_size_bytes: int | None = None, max_entries: int | None = None,
          older_than_s: float | None = None, protect: frozenset[tuple[str, str]] = frozenset(),
          why: str = "evicted", dry_run: bool = False) -> EvictionReport:
    """Remove least recently used entries until the cache is within ``max_size_bytes`` and ``max_entries``, and
    every entry last used longer than ``older_than_s`` ago. Entries in ``protect`` ((store, key) pairs) and entries
    some process holds are kept."""
    entries = list_entries(stores.values())
    total = sum(e.size_bytes for e in entries)
    count = len(entries)
    cutoff = time.time() - older_than_s if older_than_s is not None else None
    report = EvictionReport(dry_run=dry_run)
    for entry in entries:
        too_old = cutoff is not None and entry.last_used < cutoff
        too_big = max_size_bytes is not None and total > max_size_bytes
        too_many = max_entries is not None and count > max_entries
        if not (too_old or too_big or too_many):
            break
        if (entry.store, entry.key) in protect:
            continue
        if dry_run:
            outcome = "in_use" if is_held(entry.entry_dir) else "moved"
        else:
            outcome, _ = stores[entry.store].try_remove(entry.key, why)
        if outcome == "in_use":
            report.in_use.append(entry)
            continue
        if outcome == "moved":
            report.removed.append(entry)
        total -= entry.size_bytes
        count -= 1
    report.remaining_entries, report.remaining_bytes = count, total
    return report
