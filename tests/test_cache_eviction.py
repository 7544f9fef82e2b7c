"""Eviction: least recently used first, bounded by entries and size, never an entry a process holds."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kiln.engines.cache import (
    CacheCorruptError,
    CacheEntryGoneError,
    CacheEntryInUseError,
    EngineCache,
    EntryHold,
    engine_key,
    is_held,
)
from kiln.engines.cache.layout import LAST_USED
from kiln.runtime.cache_hold import IN_USE_LOCK, hold_if_cached
from tests.subprocess_env import repo_env


def material(name: str) -> dict:
    return {"key_schema": 1, "kind": "engine", "model": name}


def build_of(size: int):
    def build(out: Path) -> dict:
        (out / "rank0.safetensors").write_bytes(b"\0" * size)
        return {}
    return build


def add(cache: EngineCache, name: str, size: int = 1000, last_used: float | None = None) -> str:
    """Publish an entry for ``name`` and set its recorded last use (seconds since the epoch)."""
    key = engine_key(material(name))
    result = cache.entries.get_or_build(key, material(name), build_of(size))
    if last_used is not None:
        os.utime(result.entry_dir / LAST_USED, (last_used, last_used))
    return key


def names(cache: EngineCache) -> set[str]:
    return {cache.entries.read_manifest(key)["material"]["model"] for key in cache.entries.list_keys()}


def test_least_recently_used_entry_goes_first_not_the_oldest_created(tmp_path):
    cache = EngineCache.open(tmp_path / "c", max_entries=3)
    now = time.time()
    a = add(cache, "a", last_used=now - 100)  # created first, used recently
    add(cache, "b", last_used=now - 300)
    add(cache, "c", last_used=now - 200)
    cache.entries.lookup(a, material("a"))  # a hit records a use
    add(cache, "d")
    assert names(cache) == {"a", "c", "d"}
    add(cache, "e")
    assert names(cache) == {"a", "d", "e"}
    assert cache.entries.lookup(engine_key(material("b")), material("b")).reason == "evicted"
    assert cache.stats.summary("entries")["evictions"] == 2


def test_an_entry_held_by_a_process_is_never_evicted(tmp_path):
    cache = EngineCache.open(tmp_path / "c", max_entries=2)
    now = time.time()
    a = add(cache, "a", last_used=now - 300)
    add(cache, "b", last_used=now - 200)
    with EntryHold(cache.entries.entry_dir(a)) as hold:
        assert is_held(hold.entry_dir)
        add(cache, "c")
        assert names(cache) == {"a", "c"}
        with pytest.raises(CacheEntryInUseError):
            cache.entries.remove(a)
    assert not is_held(cache.entries.entry_dir(a))
    cache.entries.remove(a)


def test_size_bound_is_kept_after_publishing_and_spares_the_new_entry(tmp_path):
    cache = EngineCache.open(tmp_path / "c", max_size_bytes=2500)
    now = time.time()
    add(cache, "a", last_used=now - 300)
    add(cache, "b", last_used=now - 200)
    add(cache, "c")
    assert names(cache) == {"b", "c"}
    add(cache, "big", size=5000)
    assert names(cache) == {"big"}


def test_a_build_never_evicts_the_checkpoint_it_reads_and_the_limit_holds_after_it(tmp_path):
    cache = EngineCache.open(tmp_path / "c", max_entries=1)
    quantized = cache.quantized.get_or_build(engine_key(material("q")), material("q"), build_of(10))

    def build(out: Path) -> dict:  # as kiln build's build stage reads a quantized checkpoint of the cache
        with EntryHold(quantized.entry_dir):
            (out / "rank0.safetensors").write_bytes((quantized.payload_dir / "rank0.safetensors").read_bytes())
        return {}

    engine = cache.entries.get_or_build(engine_key(material("e")), material("e"), build)
    assert (engine.payload_dir / "rank0.safetensors").stat().st_size == 10
    assert (cache.entries.list_keys(), cache.quantized.list_keys()) == ([engine.key], [])


def test_a_limit_that_cannot_hold_what_must_stay_is_exceeded_with_a_warning(tmp_path):
    warnings: list[str] = []
    cache = EngineCache.open(tmp_path / "c", max_entries=1, warn=warnings.append)
    a = add(cache, "a")
    with EntryHold(cache.entries.entry_dir(a)):
        add(cache, "b")
    assert names(cache) == {"a", "b"}
    [warning] = warnings
    assert "over its limit (2 entries, limit 1)" in warning and "1 entry is in use" in warning


def test_holding_an_evicted_entry_fails_clearly(tmp_path):
    cache = EngineCache.open(tmp_path / "c")
    a = add(cache, "a")
    entry = cache.entries.entry_dir(a)
    cache.entries.remove(a)
    with pytest.raises(CacheEntryGoneError, match="build it again"):
        EntryHold(entry)


def test_an_entry_that_lost_its_in_use_lock_is_held_again_and_then_never_evicted(tmp_path):
    cache = EngineCache.open(tmp_path / "c", max_entries=1)
    a = add(cache, "a")
    (cache.entries.entry_dir(a) / IN_USE_LOCK).unlink()
    hold = hold_if_cached(cache.entries.payload_dir(a))
    assert hold is not None and is_held(cache.entries.entry_dir(a))
    add(cache, "b")
    assert names(cache) == {"a", "b"}
    hold.release()


def test_an_entry_that_lost_both_its_manifest_and_its_in_use_lock_is_refused_not_loaded(tmp_path):
    cache = EngineCache.open(tmp_path / "c")
    a = add(cache, "a")
    for name in (IN_USE_LOCK, "manifest.json"):
        (cache.entries.entry_dir(a) / name).unlink()
    with pytest.raises(CacheCorruptError, match="manifest.json is missing or unreadable"):
        hold_if_cached(cache.entries.payload_dir(a))


def test_an_engine_outside_the_cache_beside_a_manifest_of_its_own_is_not_held_or_touched(tmp_path):
    engine = tmp_path / "deploy" / "engine"
    engine.mkdir(parents=True)
    (tmp_path / "deploy" / "manifest.json").write_text('{"name": "my-model", "version": 3}')
    assert hold_if_cached(engine) is None  # before: refused as a corrupt cache entry, an in_use.lock made beside it
    assert sorted(p.name for p in (tmp_path / "deploy").iterdir()) == ["engine", "manifest.json"]


def test_a_forced_rebuild_of_a_held_entry_keeps_the_old_files_until_released(tmp_path):
    cache = EngineCache.open(tmp_path / "c")
    a = add(cache, "a")
    hold = EntryHold(cache.entries.entry_dir(a))
    cache.entries.get_or_build(a, material("a"), build_of(10), force=True)
    trash = list((cache.v1 / "tmp").glob("trash.entries.*"))
    assert len(trash) == 1 and (trash[0] / "engine" / "rank0.safetensors").stat().st_size == 1000
    hold.release()
    cache.entries.sweep()
    assert list((cache.v1 / "tmp").iterdir()) == []


def test_an_entry_loaded_by_another_live_process_is_never_evicted(tmp_path):
    import subprocess
    import sys

    cache = EngineCache.open(tmp_path / "c", max_entries=1)
    a = add(cache, "a")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from kiln.engines.cache import EntryHold; "
         "h = EntryHold(sys.argv[1]); print('held', flush=True); time.sleep(60)", str(cache.entries.entry_dir(a))],
        env=repo_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        add(cache, "b")
        assert names(cache) == {"a", "b"}
    finally:
        holder.kill()
        holder.wait()
    add(cache, "c")
    assert names(cache) == {"c"}


def test_a_forced_rebuild_says_when_it_replaces_an_entry_a_process_has_loaded(tmp_path):
    cache = EngineCache.open(tmp_path / "c", max_entries=4)
    key = add(cache, "a")
    assert not cache.entries.get_or_build(key, material("a"), build_of(10), force=True).replaced_in_use
    with EntryHold(cache.entries.entry_dir(key)):
        forced = cache.entries.get_or_build(key, material("a"), build_of(10), force=True)
    assert forced.replaced_in_use and forced.reason == "forced"


def test_a_build_holds_the_quantized_checkpoint_it_reads_whatever_its_backend(tmp_path):
    from types import SimpleNamespace

    from kiln.engines.cache import is_held
    from kiln.pipeline.stages import BuildStage

    cache = EngineCache.open(tmp_path / "cache", max_size_bytes=None, max_entries=None)
    key = "ab" * 32
    entry = cache.quantized.entry_dir(key)
    entry.mkdir(parents=True)
    (entry / "in_use.lock").touch()  # an entry that is there, as far as a hold is concerned
    ctx = SimpleNamespace(cache=cache, quantized_key=key, checkpoint_dir=tmp_path / "quantized",
                          model_dir=tmp_path / "model", checkpoint_state=SimpleNamespace(changed_files=list))
    seen = []
    build = BuildStage._holding_checkpoint(ctx, lambda tmp: seen.append(is_held(entry)) or {})
    build(tmp_path / "tmp")
    assert seen == [True] and not is_held(entry)


def test_a_cache_no_build_configured_is_bounded_by_the_default_limits(tmp_path):
    from kiln.engines.cache.engine_cache import DEFAULT_MAX_ENTRIES
    from kiln.pipeline.config import CacheSection

    cache = EngineCache.open_configured(tmp_path)  # a machine that only pulls and serves: no limits.json
    assert (cache.max_entries, cache.max_size_bytes) == (DEFAULT_MAX_ENTRIES, CacheSection().max_size_gb * 10**9)
