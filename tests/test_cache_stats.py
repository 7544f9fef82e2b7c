"""Cache statistics: counts from every lookup and load, latency percentiles, --since and --zero."""

from __future__ import annotations

import functools
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.engines.cache import StatsDB

REPO = Path(__file__).resolve().parents[1]

KEY = "ab" * 32


@pytest.fixture
def stats(tmp_path) -> StatsDB:
    return StatsDB(tmp_path / "stats.db")


def test_load_latency_summary(stats):
    for ms in [30.0, 10.0, 20.0, 40.0, 1000.0]:
        stats.record_load("entries", KEY, ms)
    load = stats.summary("entries")["load_ms"]
    # interpolated as numpy's percentiles, as every latency Kiln summarises (one home: runtime.stats.summarize)
    assert load == {"count": 5, "mean": 220.0, "p50": 30.0, "p95": 808.0, "p99": 961.6, "max": 1000.0}


def test_hits_misses_and_build_time_saved(stats):
    stats.record_lookup("entries", KEY, "new")
    stats.record_store("entries", KEY, 100, 42.0)
    stats.record_lookup("entries", KEY, "hit", 42.0)
    stats.record_lookup("entries", KEY, "hit", 42.0)
    stats.record_lookup("entries", KEY, "corrupt")
    stats.record_lookup("quantized", KEY, "new")
    summary = stats.summary("entries")
    assert (summary["lookups"], summary["hits"], summary["misses"]) == (4, 2, 2)
    assert summary["hit_rate"] == 0.5
    assert summary["misses_by_reason"] == {"new": 1, "evicted": 0, "corrupt": 1, "incompatible": 0}
    assert summary["build_seconds_saved"] == 84.0
    assert stats.hits_by_key() == {("entries", KEY): 2}


def test_since_and_zero(stats):
    stats.record_lookup("entries", KEY, "new")
    assert stats.summary("entries", since=time.time() + 60)["lookups"] == 0
    assert stats.summary("entries", since=time.time() - 60)["lookups"] == 1
    stats.record_store("entries", KEY, 100, 1.0)
    stats.record_removal("entries", KEY, 100, "evicted")
    assert stats.summary("entries")["evictions"] == 1
    stats.zero()
    assert (stats.summary("entries")["lookups"], stats.summary("entries")["evictions"]) == (0, 0)
    assert stats.was_published("entries", KEY)  # so a later miss still says "evicted", not "new"
    assert not stats.was_published("quantized", KEY)


def test_empty_stats_have_no_rate(stats):
    summary = stats.summary("entries")
    assert (summary["lookups"], summary["hit_rate"], summary["load_ms"]["p50"]) == (0, None, None)


def test_many_processes_opening_a_new_stats_database_together_all_succeed(tmp_path):
    go = tmp_path / "go"
    script = ("import sys, time; from pathlib import Path; from kiln.engines.cache.stats import StatsDB\n"
              "while not Path(sys.argv[2]).exists(): time.sleep(0.001)\n"
              "StatsDB(Path(sys.argv[1]))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "stats.db"), str(go)], cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for _ in range(12)]
    time.sleep(2)  # every process started and waiting: they open the new database at the same instant
    go.touch()
    errors = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 12, errors


@pytest.mark.parametrize("name", ["stats.db", "hashmemo.sqlite"])
def test_a_corrupt_statistics_or_memo_database_is_moved_aside_and_the_cache_keeps_working(tmp_path, caplog, name):
    from kiln.engines.cache import EngineCache
    from kiln.engines.cache.hashing import checkpoint_hash

    root = tmp_path / "cache"
    (root / "v1").mkdir(parents=True)
    damaged = root / "v1" / name
    damaged.write_bytes(b"this is not a database" * 100)
    cache = EngineCache(root, max_size_bytes=None, max_entries=None, verify_on_load="size")
    cache.stats.record_load("entries", KEY, 12.0)
    assert cache.stats.summary("entries")["load_ms"]["p50"] == 12.0
    tiny = Path(__file__).resolve().parents[1] / "models" / "tiny-llama"
    assert checkpoint_hash(tiny, memo_path=cache.hash_memo_path) == checkpoint_hash(tiny)
    aside = [p for p in (root / "v1").iterdir() if p.name.startswith(f"{name}.corrupt-")]
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not a database")
    assert "not a usable SQLite database" in caplog.text


class FullDisk(sqlite3.Connection):
    """A connection to a database on a full disk: it reads, and every write fails as SQLite's does then."""

    def execute(self, sql: str, *args) -> sqlite3.Cursor:
        if sql.startswith(("INSERT", "DELETE")):
            full = sqlite3.OperationalError("database or disk is full")
            full.sqlite_errorcode, full.sqlite_errorname = sqlite3.SQLITE_FULL, "SQLITE_FULL"
            raise full
        return super().execute(sql, *args)

    def executemany(self, sql: str, *args) -> sqlite3.Cursor:
        return self.execute(sql) if sql.startswith("INSERT") else super().executemany(sql, *args)


def test_a_full_disk_under_the_statistics_warns_once_and_rm_and_builds_go_on(tmp_path, caplog, monkeypatch):
    from kiln.engines.cache import EngineCache, engine_key
    from kiln.engines.cache import db as cache_db
    from kiln.pipeline.cache_commands import cache_app

    cache = EngineCache.open(tmp_path / "cache")
    materials = [{"key_schema": 1, "kind": "engine", "model": name} for name in ("a", "b")]
    keys = [engine_key(m) for m in materials]

    def build(out: Path) -> dict:
        (out / "engine.json").write_text("{}")
        return {}

    cache.entries.get_or_build(keys[0], materials[0], build)
    monkeypatch.setattr(sqlite3, "connect", functools.partial(sqlite3.connect, factory=FullDisk))
    monkeypatch.setattr(cache_db, "_warned", set())
    assert not cache.entries.get_or_build(keys[1], materials[1], build).hit
    assert CliRunner().invoke(cache_app, ["rm", keys[0], "--cache-dir", str(cache.root)]).exit_code == 0
    assert cache.entries.list_keys() == [keys[1]]
    assert caplog.text.count(f"{cache.stats.path}: cannot be used (database or disk is full)") == 1


def test_an_error_of_the_statements_themselves_is_raised_not_taken_for_a_full_disk(tmp_path, caplog):
    path = tmp_path / "stats.db"
    with sqlite3.connect(path) as other:  # a table of the same name with other columns
        other.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, ts REAL)")
    with pytest.raises(sqlite3.OperationalError, match="event"):
        StatsDB(path).record_lookup("entries", "a" * 64, "new")  # before: a warning to free disk space, no error
    assert "going on without it" not in caplog.text


def test_a_database_this_user_cannot_create_is_left_to_sqlite_not_a_traceback(tmp_path, monkeypatch):
    import os

    from kiln.engines.cache import db

    def refused(path, *args, **kwargs):  # a cache folder this user may read but not write
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(db.os, "open", refused)
    stats = StatsDB(tmp_path / "stats.db")
    stats.record_lookup("entries", "a" * 64, "new")
    monkeypatch.setattr(db.os, "open", os.open)
    assert stats.summary("entries")["lookups"] == 1
