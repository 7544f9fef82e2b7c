"""Where the engine cache keeps an entry: the only cache knowledge the runtime has (engines/cache reuses it)."""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

from kiln.runtime.errors import KilnError

LAYOUT_VERSION = "v1"
IN_USE_LOCK = "in_use.lock"
_KEY = re.compile(r"[0-9a-f]{64}")


class InvalidCacheKeyError(KilnError):
    """A string used as a cache key that is not 64 lowercase hex digits."""


class CacheEntryGoneError(KilnError):
    """The entry was removed (evicted, pruned, replaced) while a process was about to use it."""


def default_cache_root() -> Path:
    """$KILN_CACHE, else ~/.cache/kiln."""
    return Path(os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln").expanduser()


def is_cache_key(text: str) -> bool:
    return _KEY.fullmatch(text) is not None


def entry_dir(cache_root: Path | str | None, key: str, kind: str = "entries") -> Path:
    """`<root>/v1/<kind>/<key[:2]>/<key>`; the key is validated before it touches a path."""
    if not is_cache_key(key):
        raise InvalidCacheKeyError(f"cache key {key!r} is not 64 lowercase hex digits: copy it from `kiln cache ls`")
    root = default_cache_root() if cache_root is None else Path(cache_root).expanduser()
    return root / LAYOUT_VERSION / kind / key[:2] / key


def entry_engine_dir(cache_root: Path | str | None, key: str) -> Path:
    """The engine directory of cache entry `key`."""
    return entry_dir(cache_root, key) / "engine"


class EntryHold:
    """A shared flock on ``<entry>/in_use.lock``: while a process holds it, no eviction removes the entry.

    Removal takes the lock exclusively without blocking and renames the entry away while holding it, so a holder
    never ends up holding a removed entry (the inode check below catches a removal that raced the open)."""

    def __init__(self, entry: Path) -> None:
        self.entry_dir = Path(entry)
        lock = self.entry_dir / IN_USE_LOCK
        try:
            self._fd: int | None = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            raise CacheEntryGoneError(f"cache entry {self.entry_dir}: not there (evicted or removed); "
                                      "build it again") from None
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


def hold_entry(entry: Path) -> EntryHold:
    """Hold a cache entry (the directory holding manifest.json) so no eviction removes it while it is loaded."""
    return EntryHold(entry)


def hold_if_cached(engine_dir: Path) -> EntryHold | None:
    """Hold the cache entry an engine directory belongs to; None for an engine outside the cache."""
    entry = Path(engine_dir).parent
    return EntryHold(entry) if (entry / IN_USE_LOCK).is_file() else None
