"""Where the engine cache keeps an entry: the only cache knowledge the runtime has (engines/cache reuses it)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from runtime.errors import KilnError

LAYOUT_VERSION = "v1"
_KEY = re.compile(r"[0-9a-f]{64}")


class InvalidCacheKeyError(KilnError):
    """A string used as a cache key that is not 64 lowercase hex digits."""


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
