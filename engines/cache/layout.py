"""Where things live under a cache root, and the fsync helpers that make publishing durable.

    <root>/CACHEDIR.TAG
    <root>/v1/<store>/<key[:2]>/<key>/{manifest.json, in_use.lock, last_used, <payload>/...}
                          (stores: entries/engine, quantized/checkpoint, checkpoints/hf: generated ones)
    <root>/v1/tmp/<store>.<key>.<pid>.<rand>/      a build in progress (swept once its key lock is free)
    <root>/v1/tmp/trash.<store>.<key>.<rand>/      an entry taken out, deleted once no process holds it
    <root>/v1/quarantine/<store>.<key>.<utc time>/ a corrupt entry moved aside, removed by prune
    <root>/v1/locks/<key>.lock                     one builder per key (other stores: <store>-<key>.lock)
    <root>/v1/stats.db                             statistics (SQLite, WAL)
    <root>/v1/hashmemo.sqlite                      file sha256 digests per file identity (SQLite, WAL)
    <root>/v1/limits.json                          the size and entry limits last configured
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.engines.cache.errors import CacheDatabaseError, CacheRootError
from kiln.engines.cache.keys import is_cache_key, validate_key
from kiln.runtime.cache_hold import CORRUPT_MARK as CORRUPT_MARK  # re-exported: the runtime refuses a marked entry
from kiln.runtime.cache_hold import MANIFEST as MANIFEST  # re-exported: the runtime refuses an entry without one

LAYOUT_VERSION = "v1"
PAYLOADS = {"entries": "engine", "quantized": "checkpoint", "checkpoints": "hf"}  # each store's payload folder
LAST_USED = "last_used"
HASH_MEMO = "hashmemo.sqlite"  # in v1/: file sha256 digests per file identity (hashing.FileHashes)
CACHEDIR_TAG = (b"Signature: 8a477f597d28d172789f06886806bc55\n"
                b"# This file is a cache directory tag created by Kiln (engine cache).\n"
                b"# For information about cache directory tags see https://bford.info/cachedir/\n")


def entry_path(root: Path, store: str, key: str) -> Path:
    """``<root>/v1/<store>/<key[:2]>/<key>``; the key is validated before it touches a path."""
    return Path(root) / LAYOUT_VERSION / store / validate_key(key)[:2] / key


def payload_path(root: Path, store: str, key: str) -> Path:
    """Where the payload of entry ``key`` of ``store`` is (or would be) under a cache root."""
    return entry_path(root, store, key) / PAYLOADS[store]


def entry_of_payload(payload: Path) -> tuple[Path, str, str] | None:
    """(cache root, store, key) of a payload folder inside a cache (``<root>/v1/<store>/<key[:2]>/<key>/<payload>``);
    None for a folder elsewhere."""
    parts = Path(payload).parts
    if len(parts) < 6:
        return None
    version, store, shard, key, name = parts[-5:]
    if version != LAYOUT_VERSION or PAYLOADS.get(store) != name or not is_cache_key(key) or key[:2] != shard:
        return None
    return Path(*parts[:-5]), store, key


_SET_ROOT = "set $KILN_CACHE (or a config's cache.dir, or --cache-dir of the cache commands) to a folder you can write"


def require_creatable(root: Path) -> None:
    """CacheRootError when ``ensure_layout`` could not create a cache at ``root``, which does not exist yet: the
    nearest folder above it that exists is one this user cannot write."""
    existing = next(path for path in (root, *root.parents) if path.exists())
    if not os.access(existing, os.W_OK):
        raise CacheRootError(f"cache root {root}: cannot create {layout_root(root)} (this user cannot write "
                             f"{existing}); {_SET_ROOT}")


def ensure_layout(root: Path) -> Path:
    """Create the root, its CACHEDIR.TAG and the v1 folders; return ``<root>/v1``. CacheRootError when the root
    cannot hold a cache (a file, a folder this user cannot write)."""
    v1 = layout_root(root)
    try:
        for sub in ("tmp", "locks", "quarantine"):
            (v1 / sub).mkdir(parents=True, exist_ok=True)
        tag = root / "CACHEDIR.TAG"
        if not tag.exists():
            write_atomic(tag, CACHEDIR_TAG)
    except OSError as exc:
        raise CacheRootError(f"cache root {root}: cannot create {exc.filename or root} ({exc.strerror or exc}); "
                             f"{_SET_ROOT}") from None
    if (unwritable := _first_unwritable(v1)) is not None:  # every command writes: statistics, locks, last use
        raise CacheRootError(f"cache root {root}: cannot write {unwritable} (this user lacks permission, or the "
                             f"file system is read-only); {_SET_ROOT}, or share engines through a remote tier "
                             f"(cache.remote)")
    return v1


def open_layout(root: Path) -> tuple[Path, CacheRootError | None]:
    """``ensure_layout``, except that an existing cache this user cannot write opens read only (a volume mounted
    read-only into serving pods): ``<root>/v1`` and the CacheRootError that whatever would write there raises
    (None for a writable cache)."""
    try:
        return ensure_layout(root), None
    except CacheRootError as exc:
        if not (Path(root) / LAYOUT_VERSION).is_dir():  # no cache there to read
            raise
        return Path(root) / LAYOUT_VERSION, exc


@contextmanager
def read_only_db(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection to a database of a read-only cache that never writes (no WAL index, no journal: SQLite takes the
    file as immutable), closed after use; CacheDatabaseError when it cannot be opened or read."""
    try:
        db = sqlite3.connect(f"{Path(path).absolute().as_uri()}?mode=ro&immutable=1", uri=True)
        try:
            yield db
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:  # "malformed" too: an immutable reader of a file another process writes
        raise CacheDatabaseError(Path(path), str(exc)) from None


def _first_unwritable(v1: Path) -> Path | None:
    """The first of ``v1``, the folders and the databases in it that this user cannot write; None when all can
    be."""
    for path in (v1, *sorted(v1.iterdir())):
        if (path.is_dir() or path.suffix in (".db", ".sqlite")) and not os.access(path, os.W_OK):
            return path
    return None


def require_layout(root: Path) -> Path:
    """``<root>/v1`` of an existing cache, creating nothing; CacheRootError when there is no cache at ``root``."""
    v1 = layout_root(root)
    if not v1.is_dir():
        raise CacheRootError(f"no cache at {root}: nothing was built or pulled there yet; point $KILN_CACHE (or "
                             f"--cache-dir, cache.dir) at the cache to use")
    return v1


def layout_root(root: Path) -> Path:
    """``<root>/v1``, the folder of this layout; CacheRootError when the root is a file."""
    if root.exists() and not root.is_dir():
        raise CacheRootError(f"cache root {root} is a file, not a folder; set $KILN_CACHE (or cache.dir, "
                             f"--cache-dir) to a folder")
    return root / LAYOUT_VERSION


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write a small file through a temporary sibling, fsync it, then rename it into place."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def dir_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks not followed)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += st.st_size
    return total
