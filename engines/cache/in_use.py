"""In-use protection: a process that has an entry loaded holds a shared flock on ``<entry>/in_use.lock``.

Removal (eviction, prune, rm) takes the lock exclusively without blocking and renames the entry away while holding
it, so an entry some live process holds is never removed, and a holder never ends up holding a removed entry."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from engines.cache.errors import CacheEntryGoneError
from engines.cache.layout import IN_USE_LOCK


class EntryHold:
    """A shared hold on a cache entry; release it (or leave the ``with`` block) when the entry is unloaded."""

    def __init__(self, entry_dir: Path) -> None:
        self.entry_dir = Path(entry_dir)
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


def hold_entry(entry_dir: Path) -> EntryHold:
    """Hold a cache entry (the directory holding manifest.json) so no eviction removes it while it is loaded."""
    return EntryHold(entry_dir)


def is_held(entry_dir: Path) -> bool:
    """Whether some process holds the entry."""
    try:
        fd = os.open(Path(entry_dir) / IN_USE_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def take_out(entry_dir: Path, trash: Path, *, even_if_held: bool = False) -> str:
    """Rename an entry to ``trash`` while holding its lock exclusively (unless ``even_if_held``).

    Returns ``"moved"``, ``"in_use"`` (a process holds it; nothing done) or ``"gone"`` (already removed)."""
    try:
        fd = os.open(entry_dir / IN_USE_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        fd = None
    try:
        if fd is not None and not even_if_held:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return "in_use"
        try:
            os.rename(entry_dir, trash)
        except FileNotFoundError:
            return "gone"
        return "moved"
    finally:
        if fd is not None:
            os.close(fd)


def delete_unless_held(path: Path) -> bool:
    """Delete a taken-out entry unless a process still holds it (a later sweep deletes it then)."""
    if is_held(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True
