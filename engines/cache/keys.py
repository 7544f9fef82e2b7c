"""Cache keys: sha256 of canonical JSON key material, validation of keys before they touch a path, and completion of
a key prefix to the one key it names."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Protocol

from kiln.engines.cache.errors import CacheEntryNotFoundError, CacheUsageError, InvalidCacheKeyError

MIN_PREFIX = 4  # hex digits of a key prefix (as git's short hashes)
_KEY = re.compile(r"[0-9a-f]{64}")
_KEY_PREFIX = re.compile(rf"[0-9a-f]{{{MIN_PREFIX},64}}")


class KeyedStore(Protocol):
    """What ``complete_key`` reads of a store (a ``ContentStore``): its ``v1`` folder and the keys in its shards."""

    v1: Path

    def keys_under(self, shard_prefix: str) -> list[str]: ...


def canonical_json(obj: object) -> bytes:
    """UTF-8 JSON with sorted keys and no whitespace; NaN/Infinity and non-JSON types are refused."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def engine_key(material: dict) -> str:
    """The cache key of some key material: sha256 hex of its canonical JSON."""
    return hashlib.sha256(canonical_json(material)).hexdigest()


def is_cache_key(text: str) -> bool:
    """Whether ``text`` is a whole cache key: 64 lowercase hex digits."""
    return _KEY.fullmatch(text) is not None


def is_key_prefix(text: str) -> bool:
    """Whether ``text`` is a cache key or a prefix of one: MIN_PREFIX to 64 lowercase hex digits."""
    return _KEY_PREFIX.fullmatch(text) is not None


def validate_key(key: str) -> str:
    """Return ``key`` if it is 64 lowercase hex characters, else raise InvalidCacheKeyError naming it."""
    if not isinstance(key, str) or not is_cache_key(key):
        raise InvalidCacheKeyError(f"cache key {key!r} is not 64 lowercase hex digits: copy it from `kiln cache ls`")
    return key


def material_diff(a: object, b: object, prefix: str = "") -> list[str]:
    """Dotted paths of the fields that differ between two pieces of key material (``build.max_seq_len``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        paths: list[str] = []
        for name in sorted(set(a) | set(b), key=str):
            path = f"{prefix}.{name}" if prefix else str(name)
            if name not in a or name not in b:
                paths.append(path)
            else:
                paths.extend(material_diff(a[name], b[name], path))
        return paths
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        paths = []
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            paths.extend(material_diff(x, y, f"{prefix}[{index}]"))
        return paths
    return [] if canonical_json(a) == canonical_json(b) else [prefix or "(root)"]


def complete_key(prefix: str, stores: list[KeyedStore], what: str = "") -> str:
    """The one published key of ``stores`` that starts with ``prefix`` (at least MIN_PREFIX hex digits, or a whole
    key), as ``git`` completes a short hash; a missing or ambiguous prefix is an error that says so."""
    check_key_prefix(prefix, "kiln cache ls")
    keys = {key for store in stores for key in store.keys_under(prefix[:2])}
    root = stores[0].v1.parent if stores else "the cache"
    return match_prefix(prefix, keys, what, f"under {root}",
                        "see `kiln cache ls`, or set $KILN_CACHE to the cache that holds it")


def check_key_prefix(prefix: str, listing: str) -> None:
    """InvalidCacheKeyError unless ``prefix`` is a key or a prefix of one (``listing``: the command that shows keys)."""
    if not is_key_prefix(prefix):
        raise InvalidCacheKeyError(f"{prefix!r} is not a cache key (64 lowercase hex digits) or a prefix of one (at "
                                   f"least {MIN_PREFIX}): copy it from `{listing}`")


def match_prefix(prefix: str, keys: set[str], what: str, where: str, fix: str) -> str:
    """The one of ``keys`` that starts with ``prefix``: CacheEntryNotFoundError for none (no ``what``entry
    ``where``; ``fix``: what to do), CacheUsageError naming a few for several."""
    matches = sorted(key for key in keys if key.startswith(prefix))
    if not matches:
        raise CacheEntryNotFoundError(f"cache key {prefix}: no {what}entry {where}; {fix}")
    if len(matches) > 1:
        raise CacheUsageError(f"cache key prefix {prefix} matches {len(matches)} {what}entries "
                              f"({', '.join(m[:16] for m in matches[:4])}...): give more of the key")
    return matches[0]
