"""SQLite connections for the cache's small databases (statistics, the file-hash memo): WAL, a long busy timeout,
closed after each use. Both are expendable: a file that is not a database is moved aside with a warning and a
fresh one started, and one that cannot be written (a full disk) is done without, so a damaged memo or log never
stops the cache itself."""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

from kiln.engines.cache.errors import CacheDatabaseError

logger = logging.getLogger("kiln.cache")
T = TypeVar("T")

_CORRUPT = ("file is not a database", "database disk image is malformed")
# SQLite's errors of a database this machine cannot use (its disk, its file's permissions), by their names' prefix
_UNUSABLE = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")
_warned: set[Path] = set()  # the databases this process said it goes on without


@contextmanager
def connect(path: Path, schema: Sequence[str] = ()) -> Iterator[sqlite3.Connection]:
    """A connection in WAL mode, its ``schema`` statements (``CREATE ... IF NOT EXISTS``) applied, that commits on
    success, rolls back on error and is always closed. A database that cannot be opened or written (a full disk,
    an I/O error, a read-only file) raises CacheDatabaseError; one that is busy past the timeout stays an
    ``OperationalError`` ("database is locked"), as does an error of the statements themselves (a bug, not the
    machine)."""
    try:
        db = _open_or_replace(path, schema)
        try:
            with db:
                yield db
        finally:
            db.close()
    except sqlite3.OperationalError as exc:
        if not (getattr(exc, "sqlite_errorname", None) or "").startswith(_UNUSABLE):  # busy, or a bug in its SQL
            raise
        raise CacheDatabaseError(Path(path), str(exc)) from None


def expendable(fallback: Callable[[], T]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Make a method of a database of the cache's (which has a ``path``) answer ``fallback()`` when that database
    cannot be used, warning once per database: statistics and the memo never stop the cache itself."""
    def wrap(method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def run(self: object, *args: object, **kwargs: object) -> T:
            try:
                return method(self, *args, **kwargs)
            except CacheDatabaseError as exc:
                if exc.path not in _warned:
                    _warned.add(exc.path)
                    logger.warning("%s; going on without it", exc)
                return fallback()
        return run
    return wrap


def ensure_schema(path: Path, schema: Sequence[str]) -> None:
    """Create the database at ``path`` with its tables, if it does not have them yet."""
    with connect(path, schema):
        return


def _open_or_replace(path: Path, schema: Sequence[str]) -> sqlite3.Connection:
    """``_open``; a file that is not a database is moved aside, with a warning, and a fresh one started."""
    try:
        return _open(path, schema)
    except sqlite3.DatabaseError as exc:
        if not any(text in str(exc) for text in _CORRUPT):
            raise
        aside = _move_aside(Path(path))
        logger.warning("%s is not a usable SQLite database (%s): moved it to %s and started a fresh one", path, exc,
                       aside)
        return _open(path, schema)


def _open(path: Path, schema: Sequence[str]) -> sqlite3.Connection:
    # SQLite makes its files 0644 whatever the umask; its -wal and -shm copy this mode, which the umask now sets (a
    # file that exists, or a folder this user cannot write, is left to SQLite, which says what is wrong)
    with suppress(OSError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    db = sqlite3.connect(path, timeout=60)
    try:
        _ensure_wal(db)
        db.execute("PRAGMA synchronous=NORMAL")
        for statement in schema:
            db.execute(statement)
    except BaseException:
        db.close()
        raise
    return db


def _move_aside(path: Path) -> Path:
    """Rename a damaged database (and its WAL files) to ``NAME.corrupt-<time>``; another process may have already."""
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    for suffix in ("", "-wal", "-shm"):
        with suppress(FileNotFoundError):
            os.replace(f"{path}{suffix}", f"{aside}{suffix}")
    return aside


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
