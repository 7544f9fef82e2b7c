"""The content store's edges that mutation testing (tools/mutation/cache_store.toml) found untested: which manifests a
lookup refuses, whose locks and temporaries are whose, what stats a hit, a removal and a verify record."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

import pytest
from filelock import FileLock

from kiln.engines.cache import CacheEntryNotFoundError, EngineCache, EntryHold, InvalidCacheKeyError, engine_key
from kiln.engines.cache.errors import CacheUsageError
from kiln.engines.cache.keys import complete_key
from kiln.engines.cache.manifest import entry_size
from kiln.engines.cache.results import LookupResult
from kiln.engines.cache.verify import nearest_entry, verify_entry
from kiln.runtime.cache_hold import CacheCorruptError, hold_if_cached
from tests.test_cache_store import FakeBuild, material


@pytest.fixture
def cache(tmp_path) -> EngineCache:
    return EngineCache.open(tmp_path / "cache")


def published(cache: EngineCache, n: int = 0) -> tuple[str, dict]:
    m = material(n)
    key = engine_key(m)
    cache.entries.get_or_build(key, m, FakeBuild())
    return key, m


def events(cache: EngineCache, event: str) -> list[tuple]:
    with sqlite3.connect(cache.stats.path) as db:
        return db.execute("SELECT key, outcome, bytes, detail FROM events WHERE event=? ORDER BY rowid",
                          (event,)).fetchall()


def rewrite_manifest(cache: EngineCache, key: str, changes: dict) -> None:
    path = cache.entries.entry_dir(key) / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_build_seconds_of_a_lookup_come_from_a_numeric_manifest_field_only():
    assert LookupResult(False, "new", Path("x")).build_seconds == 0.0
    assert LookupResult(True, "hit", Path("x"), manifest={"build_seconds": "3"}).build_seconds == 0.0
    assert LookupResult(True, "hit", Path("x"), manifest={"build_seconds": 2}).build_seconds == 2.0


def test_each_store_locks_a_key_with_a_lock_file_of_its_own(cache):
    key = "ab" * 32
    paths = {store.lock_path(key) for store in (cache.entries, cache.quantized, cache.checkpoints)}
    assert len(paths) == 3 and cache.entries.lock_path(key).name == f"{key}.lock"


def test_keys_under_reads_only_the_shard_of_the_first_two_digits_and_skips_stray_files(cache):
    for key in ("ab" + "0" * 62, "ac" + "1" * 62):
        (cache.entries.dir / key[:2] / key).mkdir(parents=True)
    (cache.entries.dir / "ab.txt").write_text("not a shard")
    (cache.entries.dir / "ab" / "ab-partial").mkdir()  # in the shard, but not a key
    assert cache.entries.keys_under("ab") == ["ab" + "0" * 62]
    assert cache.entries.keys_under("ab0") == ["ab" + "0" * 62]
    assert cache.entries.list_keys() == ["ab" + "0" * 62, "ac" + "1" * 62]


@pytest.mark.parametrize(("change", "reason"), [
    (lambda key, m: {"manifest_version": 0}, "incompatible"),  # older than this Kiln's
    (lambda key, m: {"store": "checkpoints"}, "incompatible"),  # a name that sorts before "entries"
    (lambda key, m: {"store": "quantized"}, "incompatible"),  # and one after it
    (lambda key, m: {"key": "0" * 64}, "corrupt"),  # a key that sorts before this one
    (lambda key, m: {"key": "f" * 64}, "corrupt"),  # and one after it
    (lambda key, m: {"material": {**m, "backend": "a"}}, "incompatible"),  # sorts before "native"
    (lambda key, m: {"material": {**m, "backend": "z"}}, "incompatible"),  # and after it
], ids=["older-version", "store-sorting-before", "store-sorting-after", "key-sorting-before", "key-sorting-after",
        "material-sorting-before", "material-sorting-after"])
def test_a_lookup_refuses_a_manifest_that_does_not_match_in_either_direction(cache, change, reason):
    key, m = published(cache)
    rewrite_manifest(cache, key, change(key, m))
    found = cache.entries.lookup(key, m)
    assert (found.hit, found.reason) == (False, reason)
    if "manifest_version" in change(key, m):
        assert "manifest version 0, this Kiln reads" in found.detail


@pytest.mark.parametrize("direction", ["lower", "higher"])
def test_a_lookup_without_material_refuses_stored_material_of_another_key(cache, direction):
    key, m = published(cache)
    others = [material(n) for n in range(1, 40)]
    other = next(o for o in others if (engine_key(o) < key) == (direction == "lower"))
    rewrite_manifest(cache, key, {"material": other})
    found = cache.entries.lookup(key)
    assert (found.hit, found.reason) == (False, "incompatible")


def test_get_or_build_refuses_a_key_that_is_not_its_materials_whichever_way_it_sorts(cache):
    for key in ("0" * 64, "f" * 64):
        with pytest.raises(ValueError, match="is not the key of the material"):
            cache.entries.get_or_build(key, material(), FakeBuild())


def test_a_hit_through_get_or_build_records_its_use_for_lru(cache):
    key, m = published(cache)
    last_used = cache.entries.entry_dir(key) / "last_used"
    os.utime(last_used, (1, 1))
    assert cache.entries.get_or_build(key, m, FakeBuild()).hit
    assert last_used.stat().st_mtime > time.time() - 60


def test_the_recorded_build_time_is_the_build_s_duration(cache):
    class SlowBuild(FakeBuild):
        def __call__(self, out: Path) -> dict:
            time.sleep(0.05)
            return super().__call__(out)

    m = material()
    result = cache.entries.get_or_build(engine_key(m), m, SlowBuild())
    seconds = json.loads((result.entry_dir / "manifest.json").read_text())["build_seconds"]
    assert 0.05 <= seconds < 0.9 and seconds == round(seconds, 3)


def test_a_hit_on_an_entry_never_recorded_as_stored_records_the_store_with_its_size(cache):
    key, m = published(cache)
    with sqlite3.connect(cache.stats.path) as db:
        db.execute("DELETE FROM published")
        db.execute("DELETE FROM events WHERE event='store'")
    assert cache.entries.lookup(key, m).hit
    [(stored_key, outcome, size, _)] = events(cache, "store")
    assert (stored_key, outcome) == (key, "ok") and size == entry_size(cache.entries.entry_dir(key))
    cache.entries.lookup("e" * 64)  # a miss records no store
    assert len(events(cache, "store")) == 1


def test_a_waiting_builder_says_how_long_it_has_waited(cache, monkeypatch):
    import threading

    from kiln.engines.cache import store

    monkeypatch.setattr(store, "WAIT_NOTE_EVERY_S", 0.05)
    m = material()
    key = engine_key(m)
    locked = threading.Event()

    def another_builder() -> None:  # filelock's locks are per thread: this one takes and gives back its own
        with FileLock(cache.entries.lock_path(key)):
            locked.set()
            time.sleep(0.3)

    threading.Thread(target=another_builder).start()
    locked.wait(10)
    notes = []
    assert cache.entries.get_or_build(key, m, FakeBuild(), on_wait=notes.append).waited
    assert notes[0] == f"another process is building engine {key[:12]}; waiting for it"
    assert notes[1] == f"another process is building engine {key[:12]}; waiting for it (0 s so far)"


def test_quarantining_an_entry_that_is_gone_records_nothing(cache):
    assert cache.entries.quarantine("d" * 64, "flipped byte") is None
    assert events(cache, "quarantine") == []


def test_a_corrupt_entry_is_quarantined_even_while_a_process_holds_it(cache):
    key, _ = published(cache)
    with EntryHold(cache.entries.entry_dir(key)):
        target = cache.entries.quarantine(key, "flipped byte")
    assert target is not None and (target / "quarantine_reason.txt").read_text() == "flipped byte\n"
    assert not cache.entries.entry_dir(key).exists()


def test_a_lookup_records_a_use_and_a_planned_hit_whose_entry_vanished_is_a_miss(cache):
    key, m = published(cache)
    last_used = cache.entries.entry_dir(key) / "last_used"
    os.utime(last_used, (1, 1))
    assert cache.entries.lookup(key, m).hit and last_used.stat().st_mtime > time.time() - 60
    planned = cache.entries.lookup(key, m, record=False)
    cache.entries.remove(key)
    taken = cache.entries.record_hit(planned, key, m)
    assert (taken.hit, taken.reason) == (False, "evicted")


def test_a_hit_replaces_nothing(cache):
    key, m = published(cache)
    assert cache.entries.get_or_build(key, m, FakeBuild()).replaced_in_use is False


def test_removing_an_entry_a_process_holds_frees_nothing(cache):
    key, _ = published(cache)
    with EntryHold(cache.entries.entry_dir(key)):
        assert cache.entries.try_remove(key, "test") == ("in_use", 0)
    assert cache.entries.try_remove("d" * 64, "test") == ("gone", 0)
    assert events(cache, "evict") == []


def test_a_sweep_takes_only_its_own_store_s_stale_temporaries(cache):
    key, other = "a" * 64, "b" * 64
    tmp = cache.v1 / "tmp"
    lower = "0" * 64
    mine_stale = tmp / f"entries.{key}.1.aaaa"
    # the quantized and checkpoints stores' builds of the same key (names sorting after and before "entries")
    theirs = [tmp / f"quantized.{key}.1.bbbb", tmp / f"checkpoints.{key}.1.bbbb"]
    being_built = [tmp / f"entries.{other}.1.cccc", tmp / f"entries.{lower}.1.cccc"]  # keys after and before own
    odd = [tmp / f"entries.{key}.1.dddd.extra", tmp / f"entries.{key}.1"]
    for path in (mine_stale, *theirs, *being_built, *odd):
        path.mkdir(parents=True)
    locks = [FileLock(cache.quantized.lock_path(key)), FileLock(cache.checkpoints.lock_path(key)),
             FileLock(cache.entries.lock_path(other)), FileLock(cache.entries.lock_path(lower))]
    for lock in locks:
        lock.acquire()
    try:
        assert list(cache.entries.sweep(own_key=key)) == [mine_stale]
    finally:
        for lock in locks:
            lock.release()
    assert all(path.is_dir() for path in (*theirs, *being_built, *odd))


def test_nearest_skips_an_unreadable_manifest_and_picks_the_fewest_differences(cache):
    keys = sorted(published(cache, n)[0] for n in range(6))  # visited in key order
    (cache.entries.entry_dir(keys[0]) / "manifest.json").write_text("{not json")
    (cache.entries.entry_dir(keys[1]) / "manifest.json").unlink()
    (cache.entries.entry_dir(keys[3]) / "manifest.json").write_text("{}")  # no material
    keys = [keys[2], keys[4], keys[5]]
    nearest = cache.entries.read_manifest(keys[1])["material"]  # after a farther entry, before another
    wanted = {**nearest, "backend": "trtllm"}
    assert nearest_entry(cache.entries, wanted) == (keys[1], ["backend"])


def test_verify_records_why_an_entry_failed(cache):
    key, _ = published(cache)
    (cache.entries.payload_dir(key) / "engine.json").write_text("{}")
    result = verify_entry(cache.entries, key)
    [(_, outcome, _, detail)] = events(cache, "verify")
    assert outcome == "corrupt" and "engine.json" in detail and result.problems
    (cache.entries.entry_dir(key) / "manifest.json").unlink()
    broken = verify_entry(cache.entries, key)
    assert broken.files_checked == 0 and "manifest.json is missing" in broken.problems[0]
    assert events(cache, "verify")[-1][1] == "corrupt"


def test_a_file_the_manifest_does_not_list_makes_a_hit_a_corrupt_miss(cache):
    key, m = published(cache)
    (cache.entries.payload_dir(key) / ".engine.json.swp").write_text("")  # an editor's: no loader reads it
    assert cache.entries.lookup(key, m).hit
    stray = cache.entries.payload_dir(key) / "chat_template.jinja"  # a loader reads any template it finds
    stray.write_text("INJECTED {{ messages[0]['content'] }}")
    found = cache.entries.lookup(key, m)
    assert (found.hit, found.reason) == (False, "corrupt") and f"{stray}: not in the manifest" in found.detail
    assert f"{stray}: not in the manifest" in verify_entry(cache.entries, key).problems  # as verify said before


def test_a_total_bytes_that_is_not_the_files_sum_is_corrupt_to_a_lookup_and_verify(cache):
    key, m = published(cache)
    rewrite_manifest(cache, key, {"total_bytes": 10 ** 15})  # what eviction would count: every other entry out
    found = cache.entries.lookup(key, m)
    assert (found.hit, found.reason) == (False, "corrupt") and "total_bytes 1000000000000000" in found.detail
    assert "is not the sum of its files' sizes" in verify_entry(cache.entries, key).problems[0]


def test_loading_an_entry_that_verify_marked_corrupt_is_refused_until_verify_clears_it(cache):
    key, _ = published(cache)
    payload = cache.entries.payload_dir(key)
    original = (payload / "engine.json").read_bytes()
    (payload / "engine.json").write_bytes(original.upper())  # the same size: what only a hash finds
    assert verify_entry(cache.entries, key).problems
    with pytest.raises(CacheCorruptError, match="marked corrupt by `kiln cache verify`"):
        hold_if_cached(payload)  # before: LLM.load served the damaged files without a word
    (payload / "engine.json").write_bytes(original)  # put right: verify clears the mark
    assert not verify_entry(cache.entries, key).problems
    hold_if_cached(payload).release()


def test_complete_key_refuses_a_prefix_longer_than_a_key_and_lists_four_of_many_matches(cache):
    with pytest.raises(InvalidCacheKeyError, match="is not a cache key"):
        complete_key("a" * 65, [cache.entries])
    for n in range(5):
        key = "abcd" + f"{n}" * 60
        (cache.entries.dir / key[:2] / key).mkdir(parents=True)
    with pytest.raises(CacheUsageError, match=r"matches 5 entries \(abcd000000000000, abcd111111111111, "
                                              r"abcd222222222222, abcd333333333333\.\.\.\)"):
        complete_key("abcd", [cache.entries])
    with pytest.raises(CacheEntryNotFoundError, match=f"no entry under {cache.root}"):
        complete_key("abce", [cache.entries])
