"""Errors of the engine cache that a user can cause (bad key, missing or busy entry, corrupt entry)."""

from __future__ import annotations

from pathlib import Path

from kiln.runtime.cache_hold import CacheCorruptError, CacheEntryGoneError
from kiln.runtime.errors import KilnError

__all__ = ["CacheCorruptError", "CacheDatabaseError", "CacheEntryGoneError", "CacheEntryInUseError",
           "CacheEntryNotFoundError", "CacheRootError", "CacheUsageError", "CheckpointHashError",
           "InvalidCacheKeyError"]


class InvalidCacheKeyError(KilnError):
    """A string used as a cache key that is not 64 lowercase hex digits (or a prefix of at least a few)."""


class CacheEntryNotFoundError(KilnError):
    """No entry with this key in any store of the cache."""


class CacheEntryInUseError(KilnError):
    """The entry is loaded by a live process, so it cannot be removed now."""


class CacheRootError(KilnError):
    """A cache root that is no cache: not a folder, not writable (or full), or (for a command that only reads) not
    there."""


class CacheUsageError(KilnError):
    """A malformed argument to a cache command (size, duration, time)."""


class CheckpointHashError(KilnError):
    """A checkpoint directory that cannot be content-hashed (missing, no safetensors weights, pickle only)."""


class CacheDatabaseError(KilnError):
    """The statistics or hash-memo database cannot be opened or written (a full disk, an I/O error, read-only)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: cannot be used ({reason}); free space on its disk (`kiln cache prune --max-size "
                         f"SIZE`) or make it writable")
        self.path = path
