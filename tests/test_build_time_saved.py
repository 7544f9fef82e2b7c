"""The time a cache hit saves: an engine's recorded build time includes the calibration of its checkpoint, so a hit
of the engine saves the same seconds whether the checkpoint is here or the engine was pulled, counted once."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.engines.cache import EngineCache, engine_key
from kiln.engines.cache.inspect import stats_report
from kiln.engines.cache.layout import LAST_USED
from kiln.pipeline import runner
from kiln.runtime.options import RuntimeOptions
from tests.calibration_factories import quick_fp8_config


def plan(config: Path) -> tuple[runner.BuildContext, runner.Plan]:
    """``kiln build CONFIG``'s context and plan, in process, without the smoke stage."""
    ctx = runner.prepare(config, backend=None, force=False, dry_run=False, options=RuntimeOptions())
    return ctx, runner.decide(ctx, smoke=False)


def build(config: Path) -> dict:
    """``kiln build CONFIG --json``'s result, in process, without the smoke stage."""
    return runner.run(*plan(config))


def test_an_engine_hit_saves_its_calibration_too_whether_its_checkpoint_is_here_or_it_was_pulled(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setenv("KILN_CACHE_REMOTE", (tmp_path / "shared").as_uri())
    (tmp_path / "shared").mkdir()
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "a"))
    config = quick_fp8_config(tmp_path)
    first = build(config)
    a = EngineCache.open_configured(tmp_path / "a")
    calibration = a.quantized.read_manifest(first["quantized_key"])["build_seconds"]
    engine = a.entries.read_manifest(first["engine_key"])["build_seconds"]
    assert engine > calibration > 0 and first["build_seconds"] == engine and not first["build_seconds_saved"]

    last_used = a.quantized.entry_dir(first["quantized_key"]) / LAST_USED
    os.utime(last_used, (1, 1))
    here = build(config)  # cache A: the checkpoint is here, but the engine's hit does not need it
    assert last_used.stat().st_mtime > 1  # still kept as used, for LRU eviction
    assert here["cache"]["hit"] and here["build_seconds_saved"] == engine
    assert here["stages"][0]["action"] == "skip" and "not needed" in here["stages"][0]["reason"]
    assert (a.stats.summary("quantized")["lookups"], a.stats.summary("quantized")["hits"]) == (1, 0)  # the miss
    assert stats_report(a)["build_seconds_saved"] == engine

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "b"))
    pulled, local = build(config), build(config)  # cache B: the engine pulled, then hit; no checkpoint here
    assert pulled["cache"]["reason"].startswith("pulled") and local["cache"] == {"hit": True, "reason": "hit"}
    assert pulled["build_seconds_saved"] == local["build_seconds_saved"] == engine
    b = EngineCache.open_configured(tmp_path / "b")
    assert b.stats.summary("quantized")["lookups"] == 0 and stats_report(b)["build_seconds_saved"] == 2 * engine


def test_an_engine_built_after_all_counts_the_checkpoint_it_then_takes_and_records_its_calibration(tmp_path,
                                                                                                    monkeypatch):
    monkeypatch.setenv("KILN_CACHE_REMOTE", "")
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    config = quick_fp8_config(tmp_path)
    first = build(config)
    cache = EngineCache.open_configured(tmp_path / "cache")
    calibration = cache.quantized.read_manifest(first["quantized_key"])["build_seconds"]
    ctx, stages = plan(config)
    assert stages[0][1].extra.get("deferred")  # the engine is here: the checkpoint is not needed
    cache.entries.remove(first["engine_key"])  # gone after the plan: built after all, from the checkpoint
    rebuilt = runner.run(ctx, stages)
    assert not rebuilt["cache"]["hit"] and rebuilt["build_seconds_saved"] == calibration
    assert cache.stats.summary("quantized")["hits"] == 1
    assert rebuilt["build_seconds"] == cache.entries.read_manifest(first["engine_key"])["build_seconds"] > calibration


def test_the_seconds_prepare_returns_are_in_the_entrys_build_time_and_prepare_runs_only_for_a_build(tmp_path):
    cache = EngineCache.open(tmp_path / "cache")
    material = {"key_schema": 1, "kind": "engine", "model": "m"}
    key, prepared = engine_key(material), []

    def prepare() -> float:
        prepared.append(key)
        return 42.0

    def build(out: Path) -> dict:
        (out / "engine.json").write_text("{}")
        return {}

    built = cache.entries.get_or_build(key, material, build, prepare=prepare)
    hit = cache.entries.get_or_build(key, material, build, prepare=prepare)
    assert prepared == [key] and 42.0 <= built.build_seconds < 50.0
    assert hit.hit and hit.build_seconds == built.build_seconds == cache.entries.read_manifest(key)["build_seconds"]
