"""A build holds its engine's cache entry from its publish (or its hit) until the build ends: another process's
eviction for the cache's limit, run between the stages, never takes it, and the build does not fail for the limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.engines.cache import EngineCache, is_held
from kiln.pipeline import runner
from kiln.pipeline.stages import BuildContext, BuildStage, SmokeStage
from kiln.runtime.options import RuntimeOptions
from tests.calibration_factories import REPO, TINY_MODEL


def fake_native_build(ctx: BuildContext, progress: object):
    """An engine folder in no time (the smoke stage below only checks it is there)."""
    def build(tmp: Path) -> dict:
        (tmp / "engine.json").write_text("{}")
        return {}
    return build


def build(config: Path, between_stages) -> dict:
    """``kiln build CONFIG``, in process, running ``between_stages()`` before the publish and smoke stages."""
    ctx = runner.prepare(config, backend="native", force=False, dry_run=False, options=RuntimeOptions())
    plan = runner.decide(ctx)
    execute = runner._execute

    def evicting_first(stage, decision, ctx, progress) -> float:
        if stage.name in ("publish", "smoke"):
            between_stages()
        return execute(stage, decision, ctx, progress)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "_execute", evicting_first)
        return runner.run(ctx, plan)


@pytest.mark.parametrize("cached", [False, True], ids=["built", "hit"])
def test_another_process_eviction_never_takes_the_engine_before_the_build_ends(tmp_path, monkeypatch, cached):
    root = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE", str(root))
    monkeypatch.setenv("KILN_CACHE_REMOTE", "")
    monkeypatch.setattr(BuildStage, "_native_build", staticmethod(fake_native_build))
    smoke_saw: list[bool] = []
    monkeypatch.setattr(SmokeStage, "run", lambda self, ctx, decision, progress:
                        smoke_saw.append((ctx.engine_dir / "engine.json").is_file()))
    text = (REPO / "configs" / "tiny-llama-bf16.yaml").read_text().replace("../models/tiny-llama", str(TINY_MODEL))
    config = tmp_path / "tiny.yaml"
    config.write_text(text + "cache:\n  max_entries: 1\n")
    if cached:
        build(config, lambda: None)
    other = EngineCache(root, max_size_bytes=None, max_entries=0, verify_on_load="size")  # evicts what it can

    result = build(config, other.evict)
    assert result["cache"]["hit"] is cached and smoke_saw[-1]
    entry = Path(result["engine_dir"]).parent
    assert entry.is_dir() and not is_held(entry)  # held until the build ended, and no longer
    assert [e.entry_dir for e in other.evict().removed] == [entry]


def test_kiln_serve_of_a_config_keeps_the_hold_until_it_has_loaded_the_engine(tmp_path, monkeypatch):
    """``runner.run(keep_engine_hold=True)`` (kiln serve CONFIG, kiln bench): no eviction between the build and the
    load that follows it; ``release_engine`` lets it go."""
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KILN_CACHE_REMOTE", "")
    monkeypatch.setattr(BuildStage, "_native_build", staticmethod(fake_native_build))
    config = tmp_path / "tiny.yaml"
    config.write_text((REPO / "configs" / "tiny-llama-bf16.yaml").read_text()
                      .replace("../models/tiny-llama", str(TINY_MODEL)))
    ctx = runner.prepare(config, backend="native", force=False, dry_run=False, options=RuntimeOptions())
    runner.run(ctx, runner.decide(ctx, smoke=False), keep_engine_hold=True)
    assert is_held(ctx.engine_dir.parent)
    ctx.release_engine()
    assert not is_held(ctx.engine_dir.parent)
