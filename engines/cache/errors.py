"""Errors of the engine cache that a user can cause (bad key, missing or busy entry, corrupt entry)."""

from __future__ import annotations

from kiln.runtime.cache_hold import CacheCorruptError, CacheEntryGoneError
from kiln.runtime.errors import KilnError

__all__ = ["CacheCorruptError", "CacheEntryGoneError", "CacheEntryInUseError", "CacheEntryNotFoundError",
           "CacheRootError", "CacheUsageError", "CheckpointHashError", "InvalidCacheKeyError"]


class InvalidCacheKeyError(KilnError):
    """A string used as a cache key that is not 64 lowercase hex digits (or a prefix of at least a few)."""


class CacheEntryNotFoundError(KilnError):
    """No entry with this key in any store of the cache."""


class CacheEntryInUseError(KilnError):
    """The entry is loaded by a live process, so it cannot be removed now."""


class CacheRootError(KilnError):
    """A cache root that is no cache: not a folder, not writable, or (for a command that only reads) not there."""


class CacheUsageError(KilnError):
    """A malformed argument to a cache command (size, duration, time)."""


class CheckpointHashError(KilnError):
    """A checkpoint directory that cannot be content-hashed (missing, no safetensors weights, pickle only)."""
