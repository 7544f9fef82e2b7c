"""Holding a cached engine while it is loaded: the only cache knowledge the runtime has.

An engine cache entry (``engines.cache``) is a folder with ``in_use.lock`` and ``manifest.json`` beside its
``engine/``; an entry without a readable manifest is not a finished build and is refused, and so is one that ``kiln
cache verify`` marked corrupt. A process that loads the
engine holds a shared flock on the lock file (created if the entry lost it); removal (eviction, prune, rm) takes it
exclusively without blocking and renames the entry away while holding it, so an entry a live process holds is never
removed, and a holder never ends up holding a removed entry (the inode check below catches a removal that raced the
open).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from pathlib import Path

from kiln.runtime.errors import KilnError

logger = logging.getLogger("kiln.runtime")
IN_USE_LOCK = "in_use.lock"
MANIFEST = "manifest.json"
CORRUPT_MARK = "corrupt.json"  # what `kiln cache verify` leaves in an entry whose files do not match its manifest


class CacheCorruptError(KilnError):
    """A cache entry whose files do not match its manifest, or that has no readable manifest."""

    exit_code = 3


class CacheEntryGoneError(KilnError):
    """The entry was removed (evicted, pruned, replaced) while a process was about to use it."""


class EntryHold:
    """A shared flock on ``<entry>/in_use.lock``: while a process holds it, no eviction removes the entry."""

    def __init__(self, entry: Path) -> None:
        self.entry_dir = Path(entry)
        lock = self.entry_dir / IN_USE_LOCK
        try:
            self._fd: int | None = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o644)  # an entry that lost its lock
        except FileNotFoundError:  # no entry folder: taken out
            raise CacheEntryGoneError(f"cache entry {self.entry_dir}: not there (evicted or removed); "
                                      "build it again") from None
        except OSError as exc:  # a lost lock in a folder this user cannot write
            raise CacheCorruptError(f"cache entry {self.entry_dir}: {IN_USE_LOCK} is missing and cannot be made "
                                    f"({exc.strerror}); rebuild it (`kiln build --force`)") from None
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            still_there = os.stat(lock).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            still_there = False
        if not still_there:
            self.release()
            raise CacheEntryGoneError(f"cache entry {self.entry_dir}: removed while being opened; build it again")

    def release(self) -> None:
        """Let the entry be evicted again."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> EntryHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold_if_cached(engine_dir: Path) -> EntryHold | None:
    """Hold the cache entry an engine directory belongs to; None for an engine outside the cache, and, with a
    warning, for one in a cache this user cannot write (a read-only volume: the engine is served, unprotected)."""
    entry = Path(engine_dir).resolve().parent
    if not ((entry / IN_USE_LOCK).is_file() or _in_cache_layout(entry)):
        return None  # outside the cache (a deployment's own manifest.json beside an engine is not Kiln's)
    # an entry no longer there is said to be gone (EntryHold), not unreadable
    hold = EntryHold(entry) if os.access(entry, os.W_OK) or not entry.exists() else None
    try:
        manifest = json.loads((entry / MANIFEST).read_bytes())
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        if hold is not None:
            hold.release()
        fix = (f"rebuild it (`kiln build --force`) or remove it (`kiln cache rm {entry.name[:12]}`)" if hold else
               "rebuild or remove it where the cache is writable (this user cannot write it here)")
        raise CacheCorruptError(f"cache entry {entry}: {MANIFEST} is missing or unreadable, so it is not a finished "
                                f"build; {fix}")
    if (entry / CORRUPT_MARK).exists():
        if hold is not None:
            hold.release()
        raise CacheCorruptError(f"cache entry {entry}: marked corrupt by `kiln cache verify` (its {CORRUPT_MARK} "
                                f"names the files); rebuild it (`kiln build --force`), or run `kiln cache verify "
                                f"{entry.name[:12]}` again to clear a false alarm")
    if hold is None:
        logger.warning("cache entry %s is read-only for this user: loaded without holding it, so nothing keeps "
                       "another process's eviction from removing it meanwhile", entry)
    return hold


def _in_cache_layout(entry: Path) -> bool:
    """Whether ``entry`` is where an engine cache entry is (``v1/entries/<key[:2]>/<key>``, the key 64 hex digits:
    the layout of ``engines.cache.layout.entry_path`` and ``keys.is_cache_key``, which the runtime may not import):
    one whose in_use.lock was lost is still held, and one without a manifest refused."""
    return (re.fullmatch(r"[0-9a-f]{64}", entry.name) is not None and entry.parent.name == entry.name[:2]
            and entry.parent.parent.name == "entries" and entry.parent.parent.parent.name == "v1")
