"""The hash-keyed engine cache: keys, content-addressed stores, locks, eviction, statistics, verification."""

from kiln.engines.cache.engine_cache import EngineCache, read_limits
from kiln.engines.cache.errors import (
    CacheCorruptError,
    CacheEntryGoneError,
    CacheEntryInUseError,
    CacheEntryNotFoundError,
    CacheRootError,
    CacheUsageError,
    CheckpointHashError,
    InvalidCacheKeyError,
)
from kiln.engines.cache.hashing import checkpoint_files, checkpoint_hash, file_sha256
from kiln.engines.cache.in_use import EntryHold, is_held
from kiln.engines.cache.keys import canonical_json, engine_key, is_cache_key, material_diff, validate_key
from kiln.engines.cache.results import CacheResult, LookupResult
from kiln.engines.cache.stats import StatsDB
from kiln.engines.cache.store import ContentStore
from kiln.engines.cache.verify import VerifyResult

__all__ = [
    "CacheCorruptError", "CacheEntryGoneError", "CacheEntryInUseError", "CacheEntryNotFoundError", "CacheResult",
    "CacheRootError", "CacheUsageError", "CheckpointHashError", "ContentStore", "EngineCache", "EntryHold",
    "InvalidCacheKeyError", "LookupResult", "StatsDB", "VerifyResult", "canonical_json", "checkpoint_files",
    "checkpoint_hash", "engine_key", "file_sha256", "is_cache_key", "is_held", "material_diff", "read_limits",
    "validate_key",
]
