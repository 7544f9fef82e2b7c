"""One resolver of what a command is pointed at: engine directory, cache entry, key or key prefix, config name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln.engines.cache import CacheCorruptError, EngineCache, engine_key
from kiln.pipeline.config import CONFIGS_DIR
from kiln.pipeline.targets import Target, TargetError, resolve_target
from kiln.runtime.cache_hold import hold_if_cached
from kiln.runtime.errors import KilnError
from tests.test_cache_store import as_read_only_user, files_under


def publish(cache: EngineCache, name: str, key_prefix: str = "") -> str:
    """A fake engine entry (an engine.json is all the resolver reads) whose key starts with ``key_prefix``."""
    salt = 0
    while not (key := engine_key({"name": name, "salt": salt})).startswith(key_prefix):
        salt += 1

    def build(tmp):
        (tmp / "engine.json").write_text(json.dumps({"name": name}))
        return {}

    cache.entries.get_or_build(key, {"name": name, "salt": salt}, build)
    return key


def test_an_engine_directory_a_cache_entry_a_key_and_a_prefix_resolve_to_the_same_engine(tmp_path):
    cache = EngineCache.open(tmp_path / "cache")
    key = publish(cache, "a")
    engine_dir = cache.entries.payload_dir(key)
    expected = Target("engine", engine_dir, key, tmp_path / "cache")
    for text in (str(engine_dir), str(engine_dir.parent), key, key[:4], key[:20]):
        assert resolve_target(text, tmp_path / "cache") == expected
    assert expected.name == key[:12]


def test_a_resolved_cached_engine_is_held_so_no_other_process_evicts_it_before_it_loads(tmp_path):
    cache = EngineCache.open(tmp_path / "cache")
    key = publish(cache, "a")
    target = resolve_target(key[:8], tmp_path / "cache")
    other = EngineCache(tmp_path / "cache", max_size_bytes=None, max_entries=0, verify_on_load="changed")
    report = other.evict()  # another process publishing over its limits
    assert [e.key for e in report.in_use] == [key] and target.path.is_dir()
    target.hold.release()
    assert [e.key for e in other.evict().removed] == [key]


def test_an_engine_in_a_read_only_cache_is_served_by_key_prefix_and_folder_unheld_and_unrecorded(tmp_path, monkeypatch,
                                                                                                  capsys, caplog):
    cache = EngineCache.open(tmp_path / "cache")
    key = publish(cache, "a")
    engine_dir = cache.entries.payload_dir(key)
    before = files_under(tmp_path / "cache")
    as_read_only_user(monkeypatch)  # a volume built by a Job, mounted read-only into a serving pod
    expected = Target("engine", engine_dir, key, tmp_path / "cache")
    for text, cache_root in ((key, tmp_path / "cache"), (key[:6], tmp_path / "cache"),
                             (str(engine_dir), tmp_path / "writable")):
        target = resolve_target(text, cache_root)
        assert target == expected and target.hold is None
    assert hold_if_cached(engine_dir) is None and "loaded without holding it" in caplog.text
    assert capsys.readouterr().err.count("read-only for this user: its engines are checked and served") == 1
    assert files_under(tmp_path / "cache") == before
    monkeypatch.setattr(Path, "read_bytes", lambda self: b"{not json")  # its manifest unreadable
    with pytest.raises(KilnError, match="rebuild or remove it where the cache is writable") as refused:
        hold_if_cached(engine_dir)
    assert "kiln cache rm" not in str(refused.value) and "--force" not in str(refused.value)


@pytest.mark.parametrize("damage", ["flipped byte", "no manifest", "garbage manifest"])
def test_a_damaged_cache_entry_is_refused_by_key_and_by_folder(tmp_path, damage):
    cache = EngineCache.open(tmp_path / "cache")
    key = publish(cache, "a")
    engine_dir = cache.entries.payload_dir(key)
    if damage == "flipped byte":  # same size, mtime set back: only the content differs
        before = (engine_dir / "engine.json").stat()
        (engine_dir / "engine.json").write_text(json.dumps({"name": "b"}))
        os.utime(engine_dir / "engine.json", ns=(before.st_atime_ns, before.st_mtime_ns))
    elif damage == "no manifest":
        (engine_dir.parent / "manifest.json").unlink()
    else:
        (engine_dir.parent / "manifest.json").write_text("{not json")
    for text in (key[:12], str(engine_dir)):
        with pytest.raises(CacheCorruptError, match=f"cache entry {key[:12]}: .*kiln cache rm {key[:12]}"):
            resolve_target(text, tmp_path / "cache")


def test_a_newer_kilns_cache_entry_is_refused_saying_to_serve_it_with_that_kiln_not_to_remove_it(tmp_path):
    cache = EngineCache.open(tmp_path / "cache")
    key = publish(cache, "a")
    manifest_path = cache.entries.payload_dir(key).parent / "manifest.json"
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), "manifest_version": 99}))
    with pytest.raises(CacheCorruptError, match="manifest version 99.*serve it with the Kiln that built it") as refused:
        resolve_target(key[:12], tmp_path / "cache")
    assert "cache rm" not in str(refused.value)  # before: told to remove what the newer Kiln serves


def test_an_engine_outside_the_cache_is_named_by_its_folder(tmp_path):
    (tmp_path / "my-model" / "engine").mkdir(parents=True)
    (tmp_path / "my-model" / "engine" / "engine.json").write_text("{}")
    target = resolve_target(str(tmp_path / "my-model" / "engine"), tmp_path / "no-cache")
    assert target == Target("engine", (tmp_path / "my-model" / "engine").resolve()) and target.name == "my-model"


def test_configs_and_architecture_files_resolve_by_path_or_bundled_name(tmp_path):
    assert resolve_target("tiny-llama-fp8", tmp_path) == Target("config", CONFIGS_DIR / "tiny-llama-fp8.yaml")
    assert resolve_target("llama3-8b", tmp_path) == Target("architecture", CONFIGS_DIR / "models" / "llama3-8b.json")
    mine = tmp_path / "mine.yaml"
    mine.write_text("model:\n  path: x\n")
    assert resolve_target(str(mine), tmp_path) == Target("config", mine.resolve())


def test_an_ambiguous_or_unknown_prefix_and_anything_else_are_refused_saying_what_to_give(tmp_path):
    cache = EngineCache.open(tmp_path / "cache")
    first, second = publish(cache, "a", "beef"), publish(cache, "b", "beef")
    with pytest.raises(KilnError, match="beef matches 2 engine entries"):
        resolve_target("beef", tmp_path / "cache")
    assert resolve_target(first[:12], tmp_path / "cache").cache_key == first != second
    with pytest.raises(KilnError, match="cache key cafe: no engine entry"):
        resolve_target("cafe", tmp_path / "cache")
    with pytest.raises(TargetError, match="there is no engine cache at"):
        resolve_target("cafe", tmp_path / "elsewhere")
    with pytest.raises(TargetError, match="not an engine directory"):
        resolve_target(str(tmp_path), tmp_path / "cache")
    with pytest.raises(TargetError, match="not a cache key; give the engine directory"):
        resolve_target("no-such-thing.yaml", tmp_path / "cache")
    with pytest.raises(TargetError, match=r"83: .*too short for a cache key's prefix \(at least 4 hex digits\)"):
        resolve_target("83", tmp_path / "cache")
    with pytest.raises(TargetError, match=r"a Hugging Face repo id goes in a config's model.path"):
        resolve_target("meta-llama/Llama-3.1-8B-Instruct", tmp_path / "cache")  # as `vllm serve` takes it
    with pytest.raises(TargetError, match=r"no such config or architecture file, and not a cache key; give a config "
                                          r".* or an architecture file"):  # kiln bench's advice: what it takes
        resolve_target("no-such-thing.yaml", tmp_path / "cache", no_engines="kiln bench builds what it measures")
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    with pytest.raises(TargetError, match="loop.yaml: a symbolic link that leads to nothing"):
        resolve_target(str(tmp_path / "loop.yaml"), tmp_path / "cache")
