"""The engine cache of one root: its two stores, its statistics, its limits and their enforcement."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from kiln.engines.cache.errors import CacheEntryNotFoundError
from kiln.engines.cache.eviction import EvictionReport, evict
from kiln.engines.cache.keys import complete_key
from kiln.engines.cache.layout import (
    HASH_MEMO,
    PAYLOADS,
    ensure_layout,
    layout_root,
    open_layout,
    require_layout,
    write_atomic,
)
from kiln.engines.cache.remote.layout import REMOTE_STORES
from kiln.engines.cache.remote.spec import RemoteSpec
from kiln.engines.cache.remote.tier import RemoteTier
from kiln.engines.cache.stats import StatsDB
from kiln.engines.cache.store import ContentStore, VerifyOnLoad
from kiln.engines.cache.units import format_bytes

logger = logging.getLogger("kiln.cache")

LIMITS_FILE = "limits.json"
# the limits of a cache that no build has configured yet (a machine that only pulls and serves): cache.max_size_gb
# and cache.max_entries default to these
DEFAULT_MAX_SIZE_BYTES = 100 * 10**9
DEFAULT_MAX_ENTRIES = 64
REMOTE_FILE = "remote.json"  # the remote tier last configured: URL, endpoint, required (never credentials)
_warned_read_only: set[Path] = set()  # the read-only roots this process has warned of


class EngineCache:
    """``entries`` holds engines (payload ``engine/``), ``quantized`` holds quantized checkpoints (``checkpoint/``),
    ``checkpoints`` holds generated Hugging Face checkpoints (``hf/``: ``kiln bench``'s random weights).

    Limits (``max_size_bytes``, ``max_entries``) bound the whole root and are enforced after every publish, sparing
    the entry just published (so nothing a build reads is evicted before it is built); ``open`` records them in
    ``v1/limits.json`` so inspection commands can report them. With a ``remote`` tier, engines and quantized
    checkpoints are pulled from it and pushed to it; ``open`` records it in ``v1/remote.json``. ``warn`` hears when
    the remote fails and the cache goes on locally, and when entries in use keep the cache over its limits.

    An existing cache this user cannot write (a volume mounted read-only where engines are served) opens read only,
    with one warning (``read_only_ok=False``: refused, a CacheRootError): ``read_only`` is the error that a build,
    pull or removal there raises; lookups check entries as ever but record no use and no statistics, so nothing
    protects an entry in use from eviction."""

    def __init__(self, root: Path, *, max_size_bytes: int | None, max_entries: int | None,
                 verify_on_load: VerifyOnLoad, remote: RemoteSpec | None = None,
                 warn: Callable[[str], None] | None = None, read_only_ok: bool = True) -> None:
        self.root = Path(root)
        self.v1, self.read_only = open_layout(self.root) if read_only_ok else (ensure_layout(self.root), None)
        self.max_size_bytes = max_size_bytes
        self.max_entries = max_entries
        self.warn = warn or logger.warning
        if self.read_only is not None:
            self._warn_read_only()
        self.stats = StatsDB(self.v1 / "stats.db", read_only=self.read_only is not None)
        self.remote = None if remote is None else RemoteTier(remote, warn=warn)
        self.entries = ContentStore(self.v1, "entries", PAYLOADS["entries"], self.stats, label="engine",
                                    verify_on_load=verify_on_load, enforce_limits=self._enforce_limits,
                                    payload_problem=_not_an_engine, read_only=self.read_only)
        self.quantized = ContentStore(self.v1, "quantized", PAYLOADS["quantized"], self.stats,
                                      label="quantized checkpoint", verify_on_load=verify_on_load,
                                      enforce_limits=self._enforce_limits, read_only=self.read_only)
        self.checkpoints = ContentStore(self.v1, "checkpoints", PAYLOADS["checkpoints"], self.stats,
                                        label="generated checkpoint", verify_on_load=verify_on_load,
                                        enforce_limits=self._enforce_limits, read_only=self.read_only)
        for name in REMOTE_STORES:
            self.stores[name].remote = self.remote

    @classmethod
    def open(cls, root: Path, *, max_size_bytes: int | None = None, max_entries: int | None = None,
             verify_on_load: VerifyOnLoad = "changed", remote: RemoteSpec | None = None,
             warn: Callable[[str], None] | None = None) -> EngineCache:
        """Open (creating if needed) the cache at ``root`` with these limits and remote, and record them (unless it
        is read only)."""
        cache = cls(root, max_size_bytes=max_size_bytes, max_entries=max_entries, verify_on_load=verify_on_load,
                    remote=remote, warn=warn)
        if cache.read_only is not None:
            return cache
        limits = {"max_size_bytes": max_size_bytes, "max_entries": max_entries}
        if read_limits(cache.root) != limits:
            write_atomic(cache.v1 / LIMITS_FILE, json.dumps(limits).encode())
        if read_remote(cache.root) != remote:
            if remote is None:
                (cache.v1 / REMOTE_FILE).unlink(missing_ok=True)
            else:
                write_atomic(cache.v1 / REMOTE_FILE, json.dumps(vars(remote)).encode())
        return cache

    @classmethod
    def open_configured(cls, root: Path, *, remote: RemoteSpec | None = None, recorded_remote: bool = True,
                        warn: Callable[[str], None] | None = None, create: bool = True) -> EngineCache:
        """Open the cache with the limits its last configured ``open`` recorded, and ``remote`` or else (unless
        ``recorded_remote`` is False: the user turned the remote off) the remote it recorded, for the cache
        commands. ``create=False`` (the maintenance commands, which read, mark, remove or record): a root without a
        cache is a CacheRootError ("no cache at ROOT"), and nothing is created there; so is one this user cannot
        write, which serving (``create``) opens read only."""
        if not create:
            require_layout(Path(root))
        remote = remote or (read_remote(Path(root)) if recorded_remote else None)
        return cls(root, verify_on_load="changed", remote=remote, warn=warn, read_only_ok=create,
                   **read_limits(Path(root)))

    @property
    def hash_memo_path(self) -> Path:
        """Where file sha256 digests (checkpoints' and entries') are memoised per file identity."""
        return self.v1 / HASH_MEMO

    @property
    def stores(self) -> dict[str, ContentStore]:
        return {"entries": self.entries, "quantized": self.quantized, "checkpoints": self.checkpoints}

    def find(self, key_or_prefix: str) -> tuple[ContentStore, str]:
        """The store that holds the entry of a key, or of the one key that starts with a prefix of at least four hex
        digits, and that whole key; CacheEntryNotFoundError when none does."""
        key = complete_key(key_or_prefix, list(self.stores.values()))
        store = next((store for store in self.stores.values() if store.entry_dir(key).is_dir()), None)
        if store is None:  # removed since it was listed
            raise CacheEntryNotFoundError(f"cache key {key}: no entry under {self.root}; see `kiln cache ls`")
        return store, key

    def record_load(self, key: str, ms: float) -> None:
        """Record that a runtime loaded engine ``key`` in ``ms`` milliseconds (and count it as a use)."""
        self.entries.touch(key)
        self.stats.record_load("entries", key, ms)

    def evict(self, *, protect: frozenset[tuple[str, str]] = frozenset()) -> EvictionReport:
        """Enforce the limits now: least recently used entries first, never one in use or in ``protect``."""
        return evict(self.stores, max_size_bytes=self.max_size_bytes, max_entries=self.max_entries, protect=protect)

    def _warn_read_only(self) -> None:
        """Say once per process and root that this cache is used read only, and what that turns off."""
        if self.root in _warned_read_only:
            return
        _warned_read_only.add(self.root)
        self.warn(f"engine cache {self.root} is read-only for this user: its engines are checked and served, but "
                  f"nothing is built, recorded or held there (no statistics, no protection from eviction while in "
                  f"use); build into a cache you can write to add engines")

    def _enforce_limits(self, store: ContentStore, key: str) -> None:
        """Evict down to the limits after ``key`` was published in ``store``, sparing it; warn when what has to
        stay (it, and entries in use) keeps the cache over a limit."""
        if self.max_size_bytes is None and self.max_entries is None:
            return
        report = self.evict(protect=frozenset({(store.name, key)}))
        if over := self._over_limits(report):
            held = len(report.in_use)
            in_use = f" and {held} entr{'y is' if held == 1 else 'ies are'} in use by running processes" if held else ""
            self.warn(f"engine cache {self.root} stays over its limit ({over}): {store.label} {key[:12]} was just "
                      f"published{in_use}; raise cache.max_entries or cache.max_size_gb")

    def _over_limits(self, report: EvictionReport) -> str:
        """Which limits what is left after ``report``'s eviction exceeds ("" when none)."""
        over = []
        if self.max_entries is not None and report.remaining_entries > self.max_entries:
            over.append(f"{report.remaining_entries} entries, limit {self.max_entries}")
        if self.max_size_bytes is not None and report.remaining_bytes > self.max_size_bytes:
            over.append(f"{format_bytes(report.remaining_bytes)}, limit {format_bytes(self.max_size_bytes)}")
        return "; ".join(over)


def _not_an_engine(payload: Path) -> str | None:
    """Why a pulled engine payload is no engine of either backend (None when it is one)."""
    from kiln.runtime.engine import is_engine_dir

    return None if is_engine_dir(payload) else "its files hold no engine.json or kiln_trtllm.json"


def read_remote(root: Path) -> RemoteSpec | None:
    """The remote tier recorded under ``root`` (None when none was configured, or the record is unreadable)."""
    try:
        return RemoteSpec(**json.loads((layout_root(Path(root)) / REMOTE_FILE).read_bytes()))
    except (OSError, ValueError, TypeError):
        return None


def read_limits(root: Path) -> dict:
    """The limits recorded under ``root`` (the defaults when none were: a cache that only pulls is bounded too)."""
    try:
        data = json.loads((layout_root(Path(root)) / LIMITS_FILE).read_bytes())
        return {"max_size_bytes": data.get("max_size_bytes"), "max_entries": data.get("max_entries")}
    except (OSError, ValueError, AttributeError):
        return {"max_size_bytes": DEFAULT_MAX_SIZE_BYTES, "max_entries": DEFAULT_MAX_ENTRIES}
