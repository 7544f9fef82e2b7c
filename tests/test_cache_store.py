"""The content store: miss reasons, atomic publish, corrupt entries quarantined and rebuilt, forced rebuilds."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors import SafetensorError

from kiln.engines.cache import CacheEntryNotFoundError, CacheRootError, EngineCache, InvalidCacheKeyError, engine_key
from kiln.engines.cache.layout import payload_path
from kiln.engines.cache.verify import verify_entry


def material(n: int = 0) -> dict:
    return {"key_schema": 1, "kind": "engine", "checkpoint": f"{n:064x}", "backend": "native"}


class FakeBuild:
    """A build that writes a small engine and counts its calls."""

    def __init__(self, size: int = 1000) -> None:
        self.calls = 0
        self.size = size

    def __call__(self, out: Path) -> dict:
        self.calls += 1
        (out / "engine.json").write_text(json.dumps({"format": "kiln-native", "build": self.calls}))
        (out / "weights").mkdir()
        (out / "weights" / "rank0.safetensors").write_bytes(os.urandom(self.size))
        return {"engine": {"format": "kiln-native"}, "call": self.calls}


@pytest.fixture
def cache(tmp_path) -> EngineCache:
    return EngineCache.open(tmp_path / "cache")


def test_first_lookup_is_new_then_build_publishes_a_complete_entry(cache):
    m, build = material(), FakeBuild()
    key = engine_key(m)
    assert cache.entries.lookup(key, m).reason == "new"
    result = cache.entries.get_or_build(key, m, build, describe={"model": "tiny"})
    assert (result.hit, result.reason, build.calls) == (False, "new", 1)
    assert result.payload_dir == payload_path(cache.root, "entries", key)
    manifest = json.loads((result.entry_dir / "manifest.json").read_text())
    assert manifest["material"] == m and manifest["key"] == key and manifest["describe"] == {"model": "tiny"}
    assert [f["path"] for f in manifest["files"]] == ["engine.json", "weights/rank0.safetensors"]
    assert manifest["files"][1]["size"] == 1000 and len(manifest["files"][1]["sha256"]) == 64
    assert manifest["build"] == {"engine": {"format": "kiln-native"}, "call": 1}
    assert (cache.root / "CACHEDIR.TAG").read_bytes().startswith(b"Signature: 8a477f597d28d172789f06886806bc55")
    assert list((cache.v1 / "tmp").iterdir()) == []


def test_published_files_get_the_umask_s_mode_whatever_their_writer_gave_them(cache):
    def build(out: Path) -> dict:
        (out / "engine.json").write_text("{}")
        (out / "rank0.safetensors").write_bytes(b"weights")
        (out / "rank0.safetensors").chmod(0o600)  # as safetensors 0.8's save_file leaves it
        return {}

    umask = os.umask(0o022)
    try:
        result = cache.entries.get_or_build(engine_key(material()), material(), build)
    finally:
        os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in result.payload_dir.iterdir()} == \
        {"engine.json": 0o644, "rank0.safetensors": 0o644}
    assert cache.entries.lookup(result.key, material()).hit


def test_the_cache_s_databases_take_the_umask_s_mode_so_a_group_can_share_them(tmp_path):
    umask = os.umask(0o002)  # a cache shared by a group
    try:
        cache = EngineCache.open(tmp_path / "shared")
        cache.entries.get_or_build(engine_key(material()), material(), FakeBuild())
    finally:
        os.umask(umask)
    databases = [p for p in cache.v1.iterdir() if p.name.endswith((".db", ".sqlite"))]
    assert databases and {p.name: p.stat().st_mode & 0o777 for p in databases} == {p.name: 0o664 for p in databases}


def test_second_get_or_build_hits_without_building(cache):
    m, build = material(), FakeBuild()
    key = engine_key(m)
    cache.entries.get_or_build(key, m, build)
    again = cache.entries.get_or_build(key, m, build)
    assert (again.hit, again.reason, again.waited, build.calls) == (True, "hit", False, 1)
    summary = cache.stats.summary("entries")
    assert (summary["lookups"], summary["hits"], summary["misses_by_reason"]["new"]) == (2, 1, 1)


def test_planning_lookup_records_nothing(cache):
    m = material()
    cache.entries.lookup(engine_key(m), m, record=False)
    assert cache.stats.summary("entries")["lookups"] == 0
    assert not cache.entries.is_being_built(engine_key(m))  # what a dry run asks: no lock file left behind
    assert not cache.entries.lock_path(engine_key(m)).exists()


def test_failed_build_leaves_no_entry_and_no_temporary(cache):
    m = material()

    def broken(out: Path) -> dict:
        (out / "half.bin").write_bytes(b"x")
        raise RuntimeError("builder crashed")

    with pytest.raises(RuntimeError):
        cache.entries.get_or_build(engine_key(m), m, broken)
    assert not cache.entries.entry_dir(engine_key(m)).exists()
    assert list((cache.v1 / "tmp").iterdir()) == []
    assert cache.entries.get_or_build(engine_key(m), m, FakeBuild()).reason == "new"


def test_a_payload_symlink_is_refused(cache, tmp_path):
    m = material()

    def linking(out: Path) -> dict:
        (out / "link").symlink_to(tmp_path)
        return {}

    with pytest.raises(ValueError, match="regular files"):
        cache.entries.get_or_build(engine_key(m), m, linking)
    assert not cache.entries.entry_dir(engine_key(m)).exists()


def test_a_published_payload_folder_replaced_by_a_link_elsewhere_is_corrupt_not_followed(cache, tmp_path):
    m = material()
    key = engine_key(m)
    payload = cache.entries.get_or_build(key, m, FakeBuild()).payload_dir
    outside = tmp_path / "outside"
    shutil.move(payload, outside)  # the same files, so every size and digest still matches
    payload.symlink_to(outside, target_is_directory=True)
    verdict = verify_entry(cache.entries, key)
    assert not verdict.ok and verdict.problems[0] == f"{payload}: a link, not a folder of the entry"  # before: intact
    assert cache.entries.lookup(key, m, record=False).reason == "corrupt"  # not loaded from outside the cache
    assert (outside / "engine.json").is_file()  # what the link pointed at is not the cache's to touch


def test_truncated_file_is_a_corrupt_miss_then_quarantined_and_rebuilt(cache):
    m, build = material(), FakeBuild()
    key = engine_key(m)
    first = cache.entries.get_or_build(key, m, build)
    weights = first.payload_dir / "weights" / "rank0.safetensors"
    weights.write_bytes(weights.read_bytes()[:10])
    looked = cache.entries.lookup(key, m, record=False)
    assert (looked.reason, "rank0.safetensors" in looked.detail) == ("corrupt", True)
    rebuilt = cache.entries.get_or_build(key, m, build)
    assert (rebuilt.hit, rebuilt.reason, build.calls) == (False, "corrupt", 2)
    assert weights.stat().st_size == 1000
    quarantined = list((cache.v1 / "quarantine").iterdir())
    assert len(quarantined) == 1 and "rank0.safetensors" in (quarantined[0] / "quarantine_reason.txt").read_text()
    assert cache.stats.summary("entries")["misses_by_reason"]["corrupt"] == 1
    assert cache.entries.get_or_build(key, m, build).hit


@pytest.mark.parametrize("damage", ["a link loop", "a file"])
def test_a_folder_of_an_entry_that_cannot_be_read_is_corrupt_then_quarantined_and_rebuilt(cache, damage):
    m, build = material(), FakeBuild()
    key = engine_key(m)
    weights = cache.entries.get_or_build(key, m, build).payload_dir / "weights"
    shutil.rmtree(weights)
    weights.symlink_to(weights) if damage == "a link loop" else weights.write_text("not a folder")
    verdict = verify_entry(cache.entries, key)
    named = f"{weights}: a link, not a folder of the entry" if damage == "a link loop" else \
        f"{weights / 'rank0.safetensors'}: unreadable ("
    assert not verdict.ok and named in verdict.problems[0]
    assert cache.entries.lookup(key, m, record=False).reason == "corrupt"
    assert (cache.entries.get_or_build(key, m, build).reason, build.calls) == ("corrupt", 2)
    assert cache.entries.get_or_build(key, m, build).hit


NO_ROOM = r"no room to write it under {root} \(No space left on device\); free space with `kiln cache prune --max-size"
TOO_LARGE = (r"cannot write it under {root} \(File too large\): a file outgrew the size this process may write "
             r"\(ulimit -f\)")


@pytest.mark.parametrize(("error", "message"), [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), NO_ROOM),
    (SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
                     'device" })'), NO_ROOM),
    (OSError(errno.EFBIG, os.strerror(errno.EFBIG)), TOO_LARGE),  # ulimit -f: before, a traceback (or modelopt
    (SafetensorError("Error while serializing: I/O error: File too large (os error 27)"), TOO_LARGE),  # blamed)
], ids=["no-space", "no-space-safetensors", "file-too-large", "file-too-large-safetensors"])
def test_a_build_the_disk_cannot_hold_is_one_clear_error_and_leaves_nothing_behind(cache, error, message):
    key = engine_key(material())

    def fails_to_write(out: Path) -> dict:
        (out / "engine.json").write_text("{}")
        raise error

    with pytest.raises(CacheRootError, match=rf"engine {key[:12]}: " + message.format(root=cache.root)):
        cache.entries.get_or_build(key, material(), fails_to_write)
    assert list((cache.v1 / "tmp").iterdir()) == [] and not cache.entries.entry_dir(key).exists()


def test_missing_manifest_is_corrupt(cache):
    m = material()
    key = engine_key(m)
    cache.entries.get_or_build(key, m, FakeBuild())
    (cache.entries.entry_dir(key) / "manifest.json").unlink()
    assert cache.entries.lookup(key, m, record=False).reason == "corrupt"


def test_manifest_of_another_version_or_material_is_incompatible(cache):
    m = material()
    key = engine_key(m)
    cache.entries.get_or_build(key, m, FakeBuild())
    assert cache.entries.lookup(key, material(1), record=False).reason == "incompatible"
    manifest_path = cache.entries.entry_dir(key) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "manifest_version": 99}))
    assert cache.entries.lookup(key, m, record=False).reason == "incompatible"
    result = cache.entries.get_or_build(key, m, FakeBuild())
    assert (result.reason, result.hit) == ("incompatible", False)
    assert cache.entries.lookup(key, m, record=False).hit


def test_manifest_with_an_escaping_path_is_corrupt_and_never_followed(cache):
    m = material()
    key = engine_key(m)
    cache.entries.get_or_build(key, m, FakeBuild())
    manifest_path = cache.entries.entry_dir(key) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"].append({"path": "../../../../etc/passwd", "size": 1, "sha256": "0" * 64})
    manifest_path.write_text(json.dumps(manifest))
    found = cache.entries.lookup(key, m, record=False)
    assert found.reason == "corrupt" and "unsafe file path" in found.detail


def test_removed_entry_misses_as_evicted(cache):
    m = material()
    key = engine_key(m)
    cache.entries.get_or_build(key, m, FakeBuild())
    cache.entries.remove(key)
    assert cache.entries.lookup(key, m).reason == "evicted"
    assert cache.entries.get_or_build(key, m, FakeBuild()).reason == "evicted"
    assert cache.entries.lookup(key, m).reason == "hit"


def test_force_rebuilds_and_replaces_atomically(cache):
    m, build = material(), FakeBuild()
    key = engine_key(m)
    cache.entries.get_or_build(key, m, build)
    forced = cache.entries.get_or_build(key, m, build, force=True)
    assert (forced.hit, forced.reason, build.calls) == (False, "forced", 2)
    assert json.loads((forced.payload_dir / "engine.json").read_text())["build"] == 2
    assert [p.name.split(".")[0] for p in (cache.v1 / "tmp").iterdir()] == []


def flip_first_byte(path: Path, keep_mtime: bool = False) -> None:
    """Corrupt a file in place, keeping its size (with ``keep_mtime``, its mtime set back as touch -r would)."""
    before = path.stat()
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_the_default_check_on_load_catches_a_same_size_change(tmp_path, keep_mtime):
    cache = EngineCache.open(tmp_path / "cache")  # verify_on_load "changed"
    m = material()
    key = engine_key(m)
    weights = cache.entries.get_or_build(key, m, FakeBuild()).payload_dir / "weights" / "rank0.safetensors"
    flip_first_byte(weights, keep_mtime)
    found = cache.entries.lookup(key, m, record=False)
    assert found.reason == "corrupt" and "sha256 differs" in found.detail and str(weights) in found.detail
    assert EngineCache.open(tmp_path / "cache", verify_on_load="hash").entries.lookup(key, m, record=False).reason \
        == "corrupt"
    assert EngineCache.open(tmp_path / "cache", verify_on_load="size").entries.lookup(key, m, record=False).hit


def test_an_unchanged_entry_is_only_statted_on_load(tmp_path, monkeypatch):
    from kiln.engines.cache import hashing

    cache = EngineCache.open(tmp_path / "cache")
    m = material()
    key = engine_key(m)
    cache.entries.get_or_build(key, m, FakeBuild())  # publishing memoises the digests sealing computed
    hashing._memo.clear()  # another process: only the SQLite memo is left

    def no_reading(path):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(hashing, "file_sha256", no_reading)
    assert cache.entries.lookup(key, m, record=False).hit


def test_verify_names_the_flipped_file_and_marks_the_entry_for_rebuild(cache):
    m, build = material(), FakeBuild()
    key = engine_key(m)
    result = cache.entries.get_or_build(key, m, build)
    assert verify_entry(cache.entries, key).ok
    weights = result.payload_dir / "weights" / "rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[500] ^= 0x10
    weights.write_bytes(bytes(data))
    verdict = verify_entry(cache.entries, key)
    assert not verdict.ok and str(weights) in verdict.problems[0]
    assert cache.entries.get_or_build(key, m, build).reason == "corrupt"
    assert verify_entry(cache.entries, key).ok


def test_an_entry_that_verifies_intact_again_is_a_hit_not_a_rebuild(cache):
    m, build = material(), FakeBuild()
    key = engine_key(m)
    weights = cache.entries.get_or_build(key, m, build).payload_dir / "weights" / "rank0.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:500] + bytes([good[500] ^ 0x10]) + good[501:])
    assert not verify_entry(cache.entries, key).ok
    weights.write_bytes(good)  # put back
    assert verify_entry(cache.entries, key).ok
    assert cache.entries.get_or_build(key, m, build).hit


def test_quantized_store_uses_its_own_folder_payload_and_lock(cache):
    m = {"key_schema": 1, "kind": "quantized", "checkpoint": "0" * 64}
    key = engine_key(m)
    result = cache.quantized.get_or_build(key, m, FakeBuild())
    assert result.payload_dir == cache.v1 / "quantized" / key[:2] / key / "checkpoint"
    assert cache.quantized.lock_path(key).name == f"quantized-{key}.lock"
    assert cache.find(key) == cache.find(key[:6]) == (cache.quantized, key)  # a whole key or a unique prefix


def test_a_key_that_is_not_the_materials_key_is_a_programming_error(cache):
    with pytest.raises(ValueError, match="not the key of the material"):
        cache.entries.get_or_build(engine_key(material(1)), material(2), FakeBuild())


@pytest.mark.parametrize("bad", ["../../etc/passwd", "a" * 63, "A" * 64])
def test_store_refuses_malformed_keys_before_touching_a_path(cache, bad):
    with pytest.raises(InvalidCacheKeyError):
        cache.entries.get_or_build(bad, material(), FakeBuild())
    with pytest.raises(CacheEntryNotFoundError if bad == "a" * 63 else InvalidCacheKeyError):  # 63: a prefix
        cache.find(bad)
    assert not (cache.root.parent / "etc").exists()


def test_an_entry_without_a_manifest_can_be_verified_and_removed(cache):
    m = material()
    key = engine_key(m)
    cache.entries.get_or_build(key, m, FakeBuild())
    (cache.entries.entry_dir(key) / "manifest.json").unlink()
    verdict = verify_entry(cache.entries, key)
    assert not verdict.ok and "manifest.json is missing" in verdict.problems[0]
    cache.entries.remove(key)
    assert not cache.entries.entry_dir(key).exists()
    with pytest.raises(CacheEntryNotFoundError):
        cache.entries.remove(key)


def test_a_builder_killed_between_publish_and_its_stats_record_is_counted_at_the_next_hit(cache, monkeypatch):
    m = material()
    key = engine_key(m)
    monkeypatch.setattr(cache.stats, "record_store", lambda *args: None)  # the process died right after the rename
    cache.entries.get_or_build(key, m, FakeBuild())
    monkeypatch.undo()
    assert not cache.stats.was_published("entries", key)
    assert cache.entries.get_or_build(key, m, FakeBuild()).hit and cache.entries.lookup(key, m).hit
    summary = cache.stats.summary("entries")
    assert (summary["builds"], summary["hits"]) == (1, 2) and cache.stats.was_published("entries", key)
    cache.entries.remove(key)
    assert cache.entries.lookup(key, m).reason == "evicted"  # not "new": the store was recorded after all


def as_read_only_user(monkeypatch) -> None:
    """From now on this user can write nothing (a cache volume mounted read-only; root writes through any chmod)."""
    monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: not mode & os.W_OK)


def files_under(root: Path) -> dict[Path, tuple[int, int]]:
    """Every file and folder under ``root`` with its size and mtime: what a read-only user must leave as it was."""
    return {path: (path.stat().st_size, path.stat().st_mtime_ns) for path in root.rglob("*")}


def test_a_read_only_cache_serves_its_entries_and_refuses_builds_pulls_and_removals_writing_nothing(tmp_path,
                                                                                                    monkeypatch):
    writable = EngineCache.open(tmp_path / "cache", max_entries=5)
    m = material()
    key = engine_key(m)
    writable.entries.get_or_build(key, m, FakeBuild())
    before = files_under(tmp_path / "cache")
    as_read_only_user(monkeypatch)
    warnings: list[str] = []
    cache = EngineCache.open(tmp_path / "cache", max_entries=1, warn=warnings.append)
    assert cache.entries.get_or_build(key, m, FakeBuild()).hit and cache.entries.lookup(key, m).hit
    cache.record_load(key, 12.0)
    assert cache.stats.summary("entries")["builds"] == 1  # what was recorded is read
    build = FakeBuild()
    with pytest.raises(CacheRootError, match=f"engine {engine_key(material(1))[:12]} cannot be built into the "
                                             f"cache: cache root .*cannot write"):
        cache.entries.get_or_build(engine_key(material(1)), material(1), build)
    with pytest.raises(CacheRootError, match=f"engine {key[:12]} cannot be removed: cache root"):
        cache.entries.remove(key)
    assert files_under(tmp_path / "cache") == before and build.calls == 0  # no use, statistics or limits recorded
    (payload_path(cache.root, "entries", key) / "engine.json").write_text("{}")  # damaged by someone who can write
    before = files_under(tmp_path / "cache")
    assert cache.entries.lookup(key, m).reason == "corrupt"  # refused, and left where it is (not quarantined)
    assert files_under(tmp_path / "cache") == before
    assert len(warnings) == 1 and "read-only for this user" in warnings[0]


def test_a_read_only_database_that_is_not_one_is_a_cache_database_error_that_callers_fall_back_from(tmp_path):
    from kiln.engines.cache.errors import CacheDatabaseError
    from kiln.engines.cache.layout import read_only_db

    damaged = tmp_path / "stats.sqlite"
    damaged.write_bytes(b"not a database, or one another process is writing " * 100)
    with pytest.raises(CacheDatabaseError), read_only_db(damaged) as db:  # sqlite3's DatabaseError, not Operational
        db.execute("SELECT 1 FROM sqlite_master").fetchall()
