"""Where things live under a cache root, and the fsync helpers that make publishing durable.

    <root>/CACHEDIR.TAG
    <root>/v1/<store>/<key[:2]>/<key>/{manifest.json, in_use.lock, last_used, <payload>/...}
    <root>/v1/tmp/<store>.<key>.<pid>.<rand>/      a build in progress (swept once its key lock is free)
    <root>/v1/tmp/trash.<store>.<key>.<rand>/      an entry taken out, deleted once no process holds it
    <root>/v1/quarantine/<store>.<key>.<utc time>/ a corrupt entry moved aside, removed by prune
    <root>/v1/locks/<key>.lock                     one builder per key (other stores: <store>-<key>.lock)
    <root>/v1/stats.db                             statistics (SQLite, WAL)
    <root>/v1/limits.json                          the size and entry limits last configured
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from kiln.runtime.cache_layout import LAYOUT_VERSION

MANIFEST = "manifest.json"
LAST_USED = "last_used"
CORRUPT_MARK = "corrupt.json"
CACHEDIR_TAG = (b"Signature: 8a477f597d28d172789f06886806bc55\n"
                b"# This file is a cache directory tag created by Kiln (engine cache).\n"
                b"# For information about cache directory tags see https://bford.info/cachedir/\n")


def ensure_layout(root: Path) -> Path:
    """Create the root, its CACHEDIR.TAG and the v1 folders; return ``<root>/v1``."""
    v1 = root / LAYOUT_VERSION
    for sub in ("tmp", "locks", "quarantine"):
        (v1 / sub).mkdir(parents=True, exist_ok=True)
    tag = root / "CACHEDIR.TAG"
    if not tag.exists():
        write_atomic(tag, CACHEDIR_TAG)
    return v1


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
