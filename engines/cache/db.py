"""SQLite connections for the cache's small databases: WAL, a long busy timeout, closed after each use."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def connect(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection in WAL mode that commits on success, rolls back on error and is always closed."""
    db = sqlite3.connect(path, timeout=60)
    try:
        _ensure_wal(db)
        db.execute("PRAGMA synchronous=NORMAL")
        with db:
            yield db
    finally:
        db.close()


WAL_RETRY_S = 0.05
WAL_ATTEMPTS = 200  # about 10 s


def _ensure_wal(db: sqlite3.Connection) -> None:
    """Switch a new database to WAL (persistent, so later connections only read the mode). Switching needs an
    exclusive lock that SQLite's busy timeout does not wait for, so processes opening a new database together
    retry here instead of failing with "database is locked"."""
    for attempt in range(WAL_ATTEMPTS):
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == WAL_ATTEMPTS - 1:
                raise
            time.sleep(WAL_RETRY_S)
