"""``kiln cache`` commands: tables for people, --json for machines, exit 3 naming a corrupt file."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.engines.cache import CacheRootError, EngineCache, engine_key
from kiln.engines.cache.inspect import explain
from kiln.engines.cache.layout import LAST_USED
from kiln.pipeline.cache_commands import cache_app

runner = CliRunner()


def material(name: str) -> dict:
    return {"key_schema": 1, "kind": "engine", "model": name, "build": {"max_seq_len": 2048}}


def add(cache: EngineCache, name: str, size: int = 1000, days_ago: float = 0.0) -> str:
    key = engine_key(material(name))

    def build(out: Path) -> dict:
        (out / "engine.json").write_text("{}")
        (out / "rank0.safetensors").write_bytes(b"\1" * size)
        return {"engine": {"format": "kiln-native"}}

    result = cache.entries.get_or_build(key, material(name), build,
                                        describe={"model": name, "format": "fp8", "backend": "native", "gpu": "cpu"})
    when = time.time() - days_ago * 86400
    os.utime(result.entry_dir / LAST_USED, (when, when))
    return key


def kiln_cache(root: Path, *args: str):
    return runner.invoke(cache_app, [*args, "--cache-dir", str(root)])


@pytest.fixture
def cache(tmp_path) -> EngineCache:
    return EngineCache.open(tmp_path / "cache", max_size_bytes=10**9, max_entries=10)


def test_ls_lists_entries_most_recently_used_first(cache):
    old = add(cache, "old-model", days_ago=3)
    new = add(cache, "new-model")
    result = kiln_cache(cache.root, "ls", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["key"] for r in rows] == [new, old]
    assert {k: rows[0][k] for k in ("model", "format", "backend", "gpu", "size_bytes", "hits")} == \
        {"model": "new-model", "format": "fp8", "backend": "native", "gpu": "cpu", "size_bytes": 1002, "hits": 0}
    table = kiln_cache(cache.root, "ls")
    assert table.exit_code == 0
    assert new in table.stdout and "new-model" in table.stdout and "3 days ago" in table.stdout
    assert "2 entries" in table.stderr
    cache.entries.remove(old, "removed")
    assert kiln_cache(cache.root, "ls").stderr.startswith("1 entry,")


def test_show_prints_material_files_and_build_record(cache):
    key = add(cache, "tiny")
    data = json.loads(kiln_cache(cache.root, "show", key, "--json").stdout)
    assert data["material"] == material("tiny")
    assert [f["path"] for f in data["files"]] == ["engine.json", "rank0.safetensors"]
    assert data["build"] == {"engine": {"format": "kiln-native"}} and data["in_use"] is False
    human = kiln_cache(cache.root, "show", key)
    assert human.exit_code == 0 and "rank0.safetensors" in human.stdout and "key material" in human.stdout
    assert json.loads(kiln_cache(cache.root, "show", key[:8], "--json").stdout)["key"] == key  # a unique prefix


@pytest.mark.parametrize("bad", ["../../etc/passwd", "abc", "G" * 64, "AB" * 32])
@pytest.mark.parametrize("command", ["show", "rm", "verify"])
def test_malformed_keys_are_refused_with_a_clear_message(cache, command, bad):
    result = kiln_cache(cache.root, command, bad)
    assert result.exit_code == 2
    assert "64 lowercase hex" in result.stderr and "Traceback" not in result.output


def test_ls_shows_an_fp8_kv_cache_beside_the_format(cache):
    key = engine_key(material("kv"))
    describe = {"model": "kv", "format": "fp8", "kv_cache_dtype": "fp8", "backend": "native", "gpu": "cpu"}
    cache.entries.get_or_build(key, material("kv"), lambda out: (out / "engine.json").write_text("{}") and {},
                               describe=describe)
    plain = add(cache, "plain")  # an entry of an older Kiln: no kv_cache_dtype
    rows = {row["key"]: row for row in json.loads(kiln_cache(cache.root, "ls", "--json").stdout)}
    assert (rows[key]["kv_cache_dtype"], rows[plain]["kv_cache_dtype"]) == ("fp8", None)
    assert "fp8, kv fp8" in kiln_cache(cache.root, "ls").stdout


def test_unknown_key_says_so(cache):
    result = kiln_cache(cache.root, "show", "0" * 64)
    assert result.exit_code == 2 and "no entry" in result.stderr


def test_stats_json_has_the_documented_fields(cache):
    key = add(cache, "tiny")
    cache.entries.lookup(key, material("tiny"))
    cache.record_load(key, 12.0)
    data = json.loads(kiln_cache(cache.root, "stats", "--json").stdout)
    expected = {"lookups", "hits", "misses", "hit_rate", "misses_by_reason", "load_ms", "build_seconds_saved",
                "size_bytes", "max_size_bytes", "entries", "evictions"}
    assert expected <= data.keys()
    assert (data["lookups"], data["hits"], data["hit_rate"], data["entries"]) == (2, 1, 0.5, 1)
    assert data["load_ms"] == {"count": 1, "mean": 12.0, "p50": 12.0, "p95": 12.0, "p99": 12.0, "max": 12.0}
    assert data["max_size_bytes"] == 10**9 and data["size_bytes"] == 1002
    human = kiln_cache(cache.root, "stats")
    assert "50.0% hit rate" in human.stdout and "12.0 ms" in human.stdout
    assert json.loads(kiln_cache(cache.root, "stats", "--since", "1h", "--json").stdout)["lookups"] == 2
    zeroed = kiln_cache(cache.root, "stats", "--zero", "--json")
    assert json.loads(zeroed.stdout)["lookups"] == 0 and "zeroed" in zeroed.stderr
    assert kiln_cache(cache.root, "stats", "--since", "yesterday").exit_code == 2


def test_stats_keep_the_remote_pulls_recorded_once_no_remote_is_configured(cache):
    key = add(cache, "tiny")
    assert json.loads(kiln_cache(cache.root, "stats", "--json").stdout)["remote"] is None  # none, and none recorded
    cache.stats.record_remote("entries", key, "pull", "hit", seconds=0.5, size=1002)  # a `kiln cache pull`
    data = json.loads(kiln_cache(cache.root, "stats", "--json").stdout)
    assert (data["remote_hits"], data["remote"]["hits"], data["remote"]["url"]) == (0, 1, None)
    assert "remote pulls" in kiln_cache(cache.root, "stats").stdout


def test_a_size_without_a_unit_is_refused_not_read_as_bytes(cache):  # `--max-size 50` would prune everything
    add(cache, "tiny")
    result = kiln_cache(cache.root, "prune", "--max-size", "50", "--dry-run")
    assert result.exit_code == 2 and "write 50GB for gigabytes (or 50B for bytes)" in result.stderr
    assert json.loads(kiln_cache(cache.root, "prune", "--max-size", "50B", "--dry-run", "--json").stdout)["removed"]


def test_a_relative_cache_dir_is_reported_as_an_absolute_path(cache, monkeypatch):
    monkeypatch.chdir(cache.root.parent)
    key = add(cache, "tiny")
    shown = json.loads(runner.invoke(cache_app, ["show", key[:8], "--cache-dir", cache.root.name, "--json"]).stdout)
    assert shown["payload_dir"] == str(cache.entries.payload_dir(key).resolve())
    stats = json.loads(runner.invoke(cache_app, ["stats", "--cache-dir", cache.root.name, "--json"]).stdout)
    assert stats["root"] == str(cache.root.resolve())
    assert stats["load_ms"]["count"] == 0 and stats["load_ms"]["p50"] is None


def test_verify_exits_3_naming_the_flipped_file(cache):
    good = add(cache, "good")
    bad = add(cache, "bad")
    assert kiln_cache(cache.root, "verify", "--all").exit_code == 0
    weights = cache.entries.payload_dir(bad) / "rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[7] ^= 0x01
    weights.write_bytes(bytes(data))
    result = kiln_cache(cache.root, "verify", "--all")
    assert result.exit_code == 3
    assert str(weights) in result.stderr and bad in result.stderr and good not in result.stderr
    assert "CORRUPT" in result.stdout
    single = kiln_cache(cache.root, "verify", bad, "--json")
    assert single.exit_code == 3 and json.loads(single.stdout)[0]["ok"] is False
    assert f"`kiln cache verify {bad[:12]}` checks it again" in cache.entries.lookup(bad, record=False).detail
    assert kiln_cache(cache.root, "verify", good).exit_code == 0
    assert kiln_cache(cache.root, "verify").exit_code == 2


def test_prune_older_than_with_dry_run(cache):
    old = add(cache, "old", days_ago=40)
    recent = add(cache, "recent", days_ago=2)
    dry = json.loads(kiln_cache(cache.root, "prune", "--older-than", "30d", "--dry-run", "--json").stdout)
    assert [r["key"] for r in dry["removed"]] == [old] and dry["dry_run"]
    assert cache.entries.list_keys() == sorted([old, recent])
    grace = kiln_cache(cache.root, "prune", "--older-than", "30d", "--grace", "2h")  # refused, not ignored
    assert grace.exit_code == 2 and "--grace applies to --remote only" in grace.stderr
    done = kiln_cache(cache.root, "prune", "--older-than", "30d")
    assert done.exit_code == 0 and f"removed {old}" in done.stdout
    assert cache.entries.list_keys() == [recent]


def test_prune_max_size_removes_least_recently_used_first(cache):
    a = add(cache, "a", days_ago=3)
    b = add(cache, "b", days_ago=2)
    c = add(cache, "c", days_ago=1)
    report = json.loads(kiln_cache(cache.root, "prune", "--max-size", "2.1kB", "--json").stdout)
    assert [r["key"] for r in report["removed"]] == [a] and report["freed_bytes"] == 1002
    assert cache.entries.list_keys() == sorted([b, c])
    assert kiln_cache(cache.root, "prune", "--max-size", "lots").exit_code == 2


def test_rm_removes_one_entry_and_its_next_lookup_is_evicted(cache):
    key = add(cache, "tiny")
    result = kiln_cache(cache.root, "rm", key)
    assert result.exit_code == 0 and "removed" in result.stdout
    assert cache.entries.lookup(key, material("tiny")).reason == "evicted"
    assert kiln_cache(cache.root, "rm", key).exit_code == 2


def test_explain_names_the_fields_that_differ_from_the_nearest_entry(cache):
    key = add(cache, "tiny")
    changed = material("tiny")
    changed["build"]["max_seq_len"] = 4096
    report = explain(cache, changed)
    assert report["nearest_key"] == key
    assert report["differences"] == [{"field": "build.max_seq_len", "entry": 2048, "config": 4096}]
    assert explain(cache, material("tiny"))["differences"] == []


def test_build_time_saved_counts_every_store(cache):
    cache.stats.record_lookup("entries", "ab" * 32, "hit", build_seconds_saved=1.0)
    cache.stats.record_lookup("quantized", "cd" * 32, "hit", build_seconds_saved=296.9)
    data = json.loads(kiln_cache(cache.root, "stats", "--json").stdout)
    assert data["build_seconds_saved"] == pytest.approx(297.9)
    assert data["stores"]["quantized"]["build_seconds_saved"] == pytest.approx(296.9)
    human = kiln_cache(cache.root, "stats").stdout
    assert "4 min 58 s" in human and "quantized 4 min 57 s" in human


def test_opening_a_missing_cache_to_read_it_says_so_and_creates_nothing(tmp_path):
    with pytest.raises(CacheRootError, match=f"no cache at {tmp_path / 'none'}"):
        EngineCache.open_configured(tmp_path / "none", create=False)
    assert not (tmp_path / "none").exists()
    for command in (["ls"], ["verify", "--all"], ["stats"], ["prune", "--dry-run"]):
        result = kiln_cache(tmp_path / "typo", *command)
        assert result.exit_code == 2 and "no cache at" in result.stderr, command
    assert not (tmp_path / "typo").exists()


def test_a_cache_root_that_is_a_file_is_one_clear_error(tmp_path):
    (tmp_path / "file").write_text("not a cache")
    result = kiln_cache(tmp_path / "file", "ls")
    assert result.exit_code == 2 and "is a file, not a folder" in result.stderr
    assert "Traceback" not in result.output


def test_a_kiln_cache_whose_links_loop_is_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "loop"))
    result = runner.invoke(cache_app, ["ls"])
    assert result.exit_code == 2 and f"$KILN_CACHE {tmp_path / 'loop'}: its symbolic links loop" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("unwritable", ["v1", "v1/stats.db", "v1/entries"])
def test_a_cache_this_user_cannot_write_is_one_clear_error(cache, monkeypatch, unwritable):
    add(cache, "a")
    denied = cache.root / unwritable  # as a read-only copy or mount denies it (the tests may run as root)
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != denied and access(path, mode))
    for command in (["ls"], ["stats"], ["prune", "--dry-run"]):
        result = kiln_cache(cache.root, *command)
        assert result.exit_code == 2 and f"cannot write {denied} " in result.stderr, command
        assert "Traceback" not in result.output


def test_verify_refuses_an_entry_whose_manifest_names_another_key_as_lookups_do(cache):
    key = add(cache, "a")
    copy = "0" * 64
    shutil.copytree(cache.entries.entry_dir(key), cache.entries.entry_dir(copy))
    result = kiln_cache(cache.root, "verify", copy)
    assert result.exit_code == 3 and f"manifest names key '{key}'" in result.stderr
    assert cache.entries.lookup(copy).reason == "corrupt"
    assert kiln_cache(cache.root, "verify", key).exit_code == 0


@pytest.mark.parametrize(("edit", "whose"), [({"manifest_version": 2}, "a newer Kiln's entry"),
                                            ({"store": "quantized"}, "another store's entry")])
def test_verify_reports_another_kilns_entry_without_marking_it_or_failing(cache, edit, whose):
    key = add(cache, "a")
    manifest = cache.entries.entry_dir(key) / "manifest.json"
    original = manifest.read_text()
    manifest.write_text(json.dumps({**json.loads(original), **edit}))
    result = kiln_cache(cache.root, "verify", "--all")
    assert result.exit_code == 0 and "incompatible" in result.stdout and whose in result.stderr
    assert "0 entries" in result.stderr and "1 of another Kiln or store left unchecked" in result.stderr
    assert json.loads(kiln_cache(cache.root, "verify", "--all", "--json").stdout)[0]["incompatible"]
    manifest.write_text(original)  # what a Kiln that reads it sees: an entry nobody marked corrupt
    assert cache.entries.lookup(key).hit


def test_a_dry_run_prune_counts_the_temporaries_a_prune_sweeps(cache):
    stale = cache.v1 / "tmp" / f"entries.{'a' * 64}.1.abcd"
    stale.mkdir()
    (stale / "rank0.safetensors").write_bytes(b"x" * 4096)
    dry = json.loads(kiln_cache(cache.root, "prune", "--dry-run", "--json").stdout)
    assert dry["temporaries_swept"] == 1 and dry["freed_bytes"] == 4096 and stale.is_dir()
    assert "would free 4.1 kB" in kiln_cache(cache.root, "prune", "--dry-run").stderr
    done = json.loads(kiln_cache(cache.root, "prune", "--json").stdout)
    assert done["temporaries_swept"] == 1 and done["freed_bytes"] == 4096 and not stale.exists()


def test_stats_since_before_the_year_1_is_a_clear_error(cache):
    result = kiln_cache(cache.root, "stats", "--since", "9999999999d")
    assert result.exit_code == 2 and "reaches back before the year 1" in result.stderr
