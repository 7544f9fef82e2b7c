"""In-use protection: a process that has an entry loaded holds a shared flock on ``<entry>/in_use.lock``
(``runtime.cache_hold.EntryHold``, which the runtime takes when it loads an engine from the cache).

Removal (eviction, prune, rm) takes the lock exclusively without blocking and renames the entry away while holding
it, so an entry some live process holds is never removed, and a holder never ends up holding a removed entry."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from kiln.runtime.cache_hold import IN_USE_LOCK, EntryHold

__all__ = ["EntryHold", "delete_unless_held", "is_held", "take_out"]


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
