"""The cache's statistics: every lookup, load, store, eviction and verification, in SQLite (WAL) at v1/stats.db.

Any number of processes append events; ``summary`` aggregates them. Keys that were ever published are kept in a
separate table (not cleared by ``zero``), so a lookup that finds no entry for such a key says ``evicted``, not
``new``."""

from __future__ import annotations

import functools
import sqlite3
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from kiln.engines.cache.db import connect, ensure_schema, expendable
from kiln.engines.cache.layout import read_only_db
from kiln.runtime.stats import summarize

MISS_REASONS = ("new", "evicted", "corrupt", "incompatible")
REMOTE_HIT = "remote hit"  # a lookup that missed here and was pulled from the remote tier

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY, ts REAL NOT NULL, event TEXT NOT NULL, "
    "store TEXT NOT NULL, key TEXT, outcome TEXT, value REAL, bytes INTEGER, detail TEXT)",
    "CREATE INDEX IF NOT EXISTS events_by_event ON events (event, ts)",
    "CREATE TABLE IF NOT EXISTS published (store TEXT NOT NULL, key TEXT NOT NULL, ts REAL NOT NULL, "
    "PRIMARY KEY (store, key))",
)


def _recording(method: Callable[..., None]) -> Callable[..., None]:
    """A method of ``StatsDB`` that records: it records nothing in a read-only cache, and goes on without the
    database where it cannot be written (``expendable``)."""
    @expendable(lambda: None)
    @functools.wraps(method)
    def record(self: StatsDB, *args: object, **kwargs: object) -> None:
        if not self.read_only:
            method(self, *args, **kwargs)
    return record


class StatsDB:
    """Append-only event log of one cache root, safe for concurrent writers. Recording goes on without the database
    when it cannot be written (a full disk: one warning); only ``summary`` and ``zero`` then fail. ``read_only`` (a
    cache this user cannot write): nothing is recorded, what was recorded is read."""

    @expendable(lambda: None)
    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            ensure_schema(self.path, _SCHEMA)

    def _connect(self) -> AbstractContextManager[sqlite3.Connection]:
        """A connection to read the log with (one that never writes, in a read-only cache)."""
        return read_only_db(self.path) if self.read_only else connect(self.path, _SCHEMA)

    @_recording
    def _append(self, event: str, store: str, key: str | None = None, outcome: str | None = None,
                value: float | None = None, size: int | None = None, detail: str | None = None) -> None:
        with connect(self.path, _SCHEMA) as db:
            db.execute("INSERT INTO events (ts, event, store, key, outcome, value, bytes, detail) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (time.time(), event, store, key, outcome, value, size, detail))

    @_recording
    def record_lookup(self, store: str, key: str, reason: str, build_seconds_saved: float = 0.0,
                      size: int = 0) -> None:
        """One lookup: ``reason`` is ``hit``, ``remote hit`` or a miss reason; a hit of either kind saves the entry's
        recorded build time. A hit on an entry never recorded as stored (its builder was killed between the publish
        and ``record_store``) records that store now, with the entry's ``size`` and build time."""
        now = time.time()
        with connect(self.path, _SCHEMA) as db:
            if reason == "hit" and db.execute("INSERT OR IGNORE INTO published VALUES (?, ?, ?)",
                                              (store, key, now)).rowcount:
                db.execute("INSERT INTO events (ts, event, store, key, outcome, value, bytes) "
                           "VALUES (?, 'store', ?, ?, 'ok', ?, ?)", (now, store, key, build_seconds_saved, size))
            db.execute("INSERT INTO events (ts, event, store, key, outcome, value) VALUES (?, 'lookup', ?, ?, ?, ?)",
                       (now, store, key, reason, build_seconds_saved if reason in ("hit", REMOTE_HIT) else None))

    def record_load(self, store: str, key: str, ms: float) -> None:
        """One load of an entry by a runtime, with its latency."""
        self._append("load", store, key, "ok", ms)

    @_recording
    def record_store(self, store: str, key: str, size: int, build_seconds: float) -> None:
        """A newly published entry (its key is remembered as once published)."""
        now = time.time()
        with connect(self.path, _SCHEMA) as db:
            db.execute("INSERT INTO events (ts, event, store, key, outcome, value, bytes) VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (now, "store", store, key, "ok", build_seconds, size))
            db.execute("INSERT OR IGNORE INTO published VALUES (?, ?, ?)", (store, key, now))

    def record_removal(self, store: str, key: str, size: int, why: str) -> None:
        """An entry removed by eviction, prune or rm (``why``); counted under evictions."""
        self._append("evict", store, key, why, size=size)

    def record_verify(self, store: str, key: str, ok: bool, detail: str | None = None) -> None:
        """A full re-hash of an entry and its verdict."""
        self._append("verify", store, key, "ok" if ok else "corrupt", detail=detail)

    def record_quarantine(self, store: str, key: str, detail: str) -> None:
        """A corrupt entry moved aside to v1/quarantine."""
        self._append("quarantine", store, key, "corrupt", detail=detail)

    @_recording
    def record_remote(self, store: str, key: str, event: str, outcome: str, seconds: float = 0.0, size: int = 0,
                      detail: str | None = None) -> None:
        """A remote transfer: ``pull`` (``hit``, ``miss``, ``corrupt``, ``error``) or ``push`` (``pushed``,
        ``present``, ``error``), with its seconds and bytes moved. A pulled entry counts as published here."""
        now = time.time()
        with connect(self.path, _SCHEMA) as db:
            db.execute("INSERT INTO events (ts, event, store, key, outcome, value, bytes, detail) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (now, f"remote_{event}", store, key, outcome, seconds, size,
                                                            detail))
            if event == "pull" and outcome == "hit":
                db.execute("INSERT OR IGNORE INTO published VALUES (?, ?, ?)", (store, key, now))

    @expendable(lambda: False)
    def was_published(self, store: str, key: str) -> bool:
        """Whether an entry for this key was ever published here (so its absence means it was removed)."""
        with self._connect() as db:
            return db.execute("SELECT 1 FROM published WHERE store=? AND key=?", (store, key)).fetchone() is not None

    @expendable(dict)
    def hits_by_key(self) -> dict[tuple[str, str], int]:
        """Hit counts per (store, key) since the last ``zero``, pulls from the remote tier included (as ``summary``
        counts them)."""
        with self._connect() as db:
            rows = db.execute("SELECT store, key, COUNT(*) FROM events WHERE event='lookup' AND outcome IN ('hit', ?) "
                              "GROUP BY store, key", (REMOTE_HIT,)).fetchall()
        return {(store, key): count for store, key, count in rows}

    def zero(self) -> None:
        """Forget all events (the record of published keys stays)."""
        with connect(self.path, _SCHEMA) as db:
            db.execute("DELETE FROM events")

    def summary(self, store: str, since: float | None = None) -> dict:
        """Lookups, hits, misses by reason, hit rate, load latency, build time saved and evictions of one store."""
        since = since if since is not None else float("-inf")
        with self._connect() as db:
            lookups = dict(db.execute("SELECT outcome, COUNT(*) FROM events WHERE event='lookup' AND store=? "
                                      "AND ts>=? GROUP BY outcome", (store, since)).fetchall())
            saved = db.execute("SELECT COALESCE(SUM(value), 0) FROM events WHERE event='lookup' AND store=? "
                               "AND outcome IN ('hit', ?) AND ts>=?", (store, REMOTE_HIT, since)).fetchone()[0]
            loads = [row[0] for row in db.execute("SELECT value FROM events WHERE event='load' AND store=? AND ts>=? "
                                                  "ORDER BY value", (store, since))]
            evictions = db.execute("SELECT COUNT(*) FROM events WHERE event='evict' AND store=? AND ts>=?",
                                   (store, since)).fetchone()[0]
            builds = db.execute("SELECT COUNT(*), COALESCE(SUM(value), 0) FROM events WHERE event='store' "
                                "AND store=? AND ts>=?", (store, since)).fetchone()
            remote = db.execute("SELECT event, outcome, COUNT(*), COALESCE(SUM(value), 0), COALESCE(SUM(bytes), 0) "
                                "FROM events WHERE event IN ('remote_pull', 'remote_push') AND store=? AND ts>=? "
                                "GROUP BY event, outcome", (store, since)).fetchall()
        remote_hits = lookups.get(REMOTE_HIT, 0)
        hits = lookups.get("hit", 0) + remote_hits
        misses_by_reason = {reason: lookups.get(reason, 0) for reason in MISS_REASONS}
        total = hits + sum(misses_by_reason.values())
        return {
            "lookups": total,
            "hits": hits,
            "remote_hits": remote_hits,
            "misses": total - hits,
            "hit_rate": hits / total if total else None,
            "misses_by_reason": misses_by_reason,
            "load_ms": summarize(loads, digits=2),
            "build_seconds_saved": round(float(saved), 3),
            "builds": builds[0],
            "build_seconds": round(float(builds[1]), 3),
            "evictions": evictions,
            "remote": remote_summary(remote),
        }


REMOTE_PULL_OUTCOMES = ("hit", "miss", "corrupt", "error")
REMOTE_PUSH_OUTCOMES = ("pushed", "present", "error")


def remote_summary(rows: list[tuple[str, str, int, float, int]]) -> dict:
    """Counts of remote pulls and pushes by outcome, with the bytes moved and the seconds they took."""
    by = {(event, outcome): (count, seconds, size) for event, outcome, count, seconds, size in rows}
    pulls = {outcome: by.get(("remote_pull", outcome), (0, 0.0, 0)) for outcome in REMOTE_PULL_OUTCOMES}
    pushes = {outcome: by.get(("remote_push", outcome), (0, 0.0, 0)) for outcome in REMOTE_PUSH_OUTCOMES}
    return {
        "hits": pulls["hit"][0], "misses": pulls["miss"][0], "corrupt": pulls["corrupt"][0],
        "errors": pulls["error"][0] + pushes["error"][0],
        "pulled_bytes": pulls["hit"][2], "pull_seconds": round(pulls["hit"][1], 3),
        "pushes": pushes["pushed"][0], "already_present": pushes["present"][0],
        "pushed_bytes": pushes["pushed"][2], "push_seconds": round(pushes["pushed"][1], 3),
    }
