"""SQLite connections for the cache's small databases: WAL, a long busy timeout, closed after each use."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def connect(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection in WAL mode that commits on success, rolls back on error and is always closed."""
    db = sqlite3.connect(path, timeout=60)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        with db:
            yield db
    finally:
        db.close()
