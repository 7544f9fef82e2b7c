"""A content-addressed store of built artefacts: lookup with miss reasons, one builder per key, atomic publish.

A build writes into ``v1/tmp/``; its files are fsync'ed, the manifest (key material, per-file sha256 and sizes,
build record) is written last, and one ``rename`` makes the entry visible. The per-key lock only avoids duplicate
work: a reader never sees a half-written entry because nothing but a complete one is ever renamed into place."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from filelock import FileLock, Timeout

from kiln.engines.cache import transfer
from kiln.engines.cache.errors import (
    CacheCorruptError,
    CacheEntryGoneError,
    CacheEntryInUseError,
    CacheEntryNotFoundError,
    CacheRootError,
    CacheUsageError,
)
from kiln.engines.cache.hashing import FileHashes, file_sha256
from kiln.engines.cache.in_use import EntryHold, delete_unless_held, is_held, take_out
from kiln.engines.cache.keys import canonical_json, complete_key, engine_key, is_cache_key, validate_key
from kiln.engines.cache.layout import (
    CORRUPT_MARK,
    HASH_MEMO,
    LAST_USED,
    MANIFEST,
    dir_size,
    entry_path,
    fsync_dir,
    write_atomic,
)
from kiln.engines.cache.manifest import (
    MANIFEST_VERSION,
    entry_size,
    file_problems,
    manifest_mismatch,
    read_manifest,
    seal_payload,
    stray_files,
)
from kiln.engines.cache.remote.tier import PushResult, RemoteTier, Transferred
from kiln.engines.cache.results import CacheResult, LookupResult
from kiln.engines.cache.stats import REMOTE_HIT, StatsDB
from kiln.engines.cache.units import iso_utc
from kiln.runtime.cache_hold import IN_USE_LOCK

WAIT_NOTE_EVERY_S = 30.0
# "No space left on device", "Disk quota exceeded", "File too large" (a file-size limit: ulimit -f, the file system's)
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_FULL_WORDS = tuple(map(os.strerror, _FULL_ERRNOS))
# what to do about each
_FULL = "; free space with `kiln cache prune --max-size SIZE` or point $KILN_CACHE at a larger disk"
_TOO_LARGE = (": a file outgrew the size this process may write (ulimit -f) or the file system holds; raise that "
              "limit or point $KILN_CACHE at another file system")

VerifyOnLoad = Literal["size", "changed", "hash"]  # "changed": re-hash the files changed since they were last hashed


class ContentStore:
    """One store of a cache root (``entries`` for engines, ``quantized`` for quantized checkpoints). With a
    ``remote`` tier, a local miss pulls the entry from it before building, and a new build is pushed to it.

    ``read_only`` (a root this user cannot write: the error saying so): entries are looked up and checked as ever,
    but uses and the hash memo are not recorded, and what would write (a build, a pull, a removal) raises it."""

    def __init__(self, v1: Path, name: str, payload_name: str, stats: StatsDB, *, label: str | None = None,
                 verify_on_load: VerifyOnLoad = "changed",
                 enforce_limits: Callable[[ContentStore, str], None] | None = None,
                 remote: RemoteTier | None = None, payload_problem: Callable[[Path], str | None] | None = None,
                 read_only: CacheRootError | None = None) -> None:
        self.v1 = v1
        self.payload_problem = payload_problem  # why a pulled payload is not one (its manifest may have been edited)
        self.name = name
        self.label = label or name
        self.payload_name = payload_name
        self.dir = v1 / name
        self.stats = stats
        self.verify_on_load = verify_on_load
        self.read_only = read_only
        self.hashes = FileHashes(v1 / HASH_MEMO)
        self._enforce_limits = enforce_limits
        self.remote = remote
        if read_only is None:
            self.dir.mkdir(parents=True, exist_ok=True)

    # -- paths -------------------------------------------------------------------------------------------------

    def entry_dir(self, key: str) -> Path:
        """``<store>/<key[:2]>/<key>``; the key is validated first."""
        return entry_path(self.v1.parent, self.name, key)

    def payload_dir(self, key: str) -> Path:
        return self.entry_dir(key) / self.payload_name

    def lock_path(self, key: str) -> Path:
        prefix = "" if self.name == "entries" else f"{self.name}-"
        return self.v1 / "locks" / f"{prefix}{validate_key(key)}.lock"

    def list_keys(self) -> list[str]:
        """Keys of the published entries (sorted)."""
        return self.keys_under("")

    def keys_under(self, shard_prefix: str) -> list[str]:
        """Keys of the published entries in the shards whose names start with ``shard_prefix`` (sorted)."""
        found = []
        for shard in self.dir.iterdir() if self.dir.is_dir() else ():
            if not shard.name.startswith(shard_prefix[:2]) or not shard.is_dir():
                continue
            found += [entry.name for entry in shard.iterdir()
                      if entry.name.startswith(shard.name) and is_cache_key(entry.name)]
        return sorted(found)

    def complete_key(self, prefix: str) -> str:
        """The one published key of this store that starts with ``prefix`` (``complete_key``)."""
        return complete_key(prefix, [self], f"{self.label} ")

    def read_manifest(self, key: str) -> dict:
        """The manifest of a published entry: CacheEntryNotFoundError without an entry, CacheCorruptError when the
        entry's manifest is missing or unreadable."""
        entry = self.entry_dir(key)
        if not entry.is_dir():
            raise CacheEntryNotFoundError(f"cache key {key}: no {self.label} entry; see `kiln cache ls`")
        manifest = read_manifest(entry)
        if manifest is None:
            raise CacheCorruptError(f"cache key {key}: {entry / MANIFEST} is missing or unreadable; remove the entry "
                                    f"with `kiln cache rm {key}`")
        return manifest

    # -- lookup ------------------------------------------------------------------------------------------------

    def lookup(self, key: str, material: dict | None = None, *, record: bool = True) -> LookupResult:
        """Check an entry without building; records the lookup and, on a hit, its last use (``record=False``: no
        side effects, for planning)."""
        if not record:
            return self._check(key, material)
        found = self._find(key, material)
        self._record_lookup(key, found)
        return found

    def record_hit(self, found: LookupResult, key: str, material: dict | None = None) -> LookupResult:
        """Take up a hit that a planning lookup (``record=False``) found: record its use and the lookup, without
        checking the entry's files a second time; an entry that vanished meanwhile is looked up again."""
        if not self._touch(found.entry_dir):
            return self.lookup(key, material)
        self._record_lookup(key, found)
        return found

    def _record_lookup(self, key: str, found: LookupResult) -> None:
        size = entry_size(found.entry_dir, found.manifest) if found.hit else 0  # a hit's manifest records it
        self.stats.record_lookup(self.name, key, found.reason, found.build_seconds, size)

    def _find(self, key: str, material: dict | None) -> LookupResult:
        """``_check``, and on a hit record the use (an entry that vanished meanwhile is looked up again)."""
        found = self._check(key, material)
        if found.hit and not self._touch(found.entry_dir):
            return self._check(key, material)
        return found

    def _find_held(self, key: str, material: dict | None, hold: bool) -> tuple[LookupResult, EntryHold | None]:
        """``_find``, with ``hold`` holding the entry before it is checked, so that no process's eviction takes a hit
        before the caller is done with it (the hold is released on a miss)."""
        held = self.hold(key) if hold else None
        found = self._find(key, material)
        if not found.hit and held is not None:
            held.release()
            held = None
        return found, held

    def hold(self, key: str) -> EntryHold | None:
        """Hold entry ``key`` against every process's eviction (``EntryHold``); None when it is not there, or in a
        read-only cache (where nothing is held)."""
        if self.read_only is not None:
            return None
        try:
            return EntryHold(self.entry_dir(key))
        except CacheEntryGoneError:
            return None

    def _check(self, key: str, material: dict | None) -> LookupResult:
        """Is the entry there, compatible and complete (every file at its recorded size, or hash)? No side effects."""
        entry = self.entry_dir(key)
        if not entry.is_dir():
            return LookupResult(False, "evicted" if self.stats.was_published(self.name, key) else "new", entry)
        try:
            manifest = json.loads((entry / MANIFEST).read_bytes())
        except FileNotFoundError:
            return LookupResult(False, "corrupt", entry, f"{entry}: {MANIFEST} is missing")
        except ValueError:
            return LookupResult(False, "corrupt", entry, f"{entry}: {MANIFEST} is not valid JSON")
        if (mismatch := manifest_mismatch(manifest, self.name, key)) is not None:
            return LookupResult(False, mismatch[0], entry, f"{entry}: {mismatch[1]}")
        if material is not None and canonical_json(material) != canonical_json(manifest["material"]):
            return LookupResult(False, "incompatible", entry, f"{entry}: stored key material differs", manifest)
        if (entry / CORRUPT_MARK).exists():
            return LookupResult(False, "corrupt", entry, f"{entry}: marked corrupt by `kiln cache verify` (`kiln cache "
                                f"verify {key[:12]}` checks it again and clears a false alarm)", manifest)
        digest = {"size": None, "changed": self.hashes.sha256, "hash": file_sha256}[self.verify_on_load]
        problems = (file_problems(entry, self.payload_name, manifest, digest=digest, first_only=True)
                    or stray_files(entry, self.payload_name, manifest, hidden=False))  # a loader reads what it finds
        if problems:
            return LookupResult(False, "corrupt", entry, problems[0], manifest)
        return LookupResult(True, "hit", entry, "", manifest)

    # -- build -------------------------------------------------------------------------------------------------

    def get_or_build(self, key: str, material: dict, build: Callable[[Path], dict], *, force: bool = False,
                     describe: dict | None = None, on_wait: Callable[[str], None] | None = None,
                     on_transfer: Transferred | None = None, prepare: Callable[[], float] | None = None,
                     hold: bool = False) -> CacheResult:
        """Return the entry for ``key``, building it with ``build(tmp_payload_dir) -> build record`` on a miss.

        Concurrent callers for one key build once: the others wait on the key's lock (``on_wait`` is told) and then
        hit. With a remote tier, a local miss is pulled from the remote when it has the entry (``on_transfer``
        hears the bytes), machines share one build through the remote's lease, and a build is pushed. ``force``
        rebuilds and atomically replaces an existing entry (and the remote's). One lookup is recorded per call.

        ``prepare`` runs only when a build is due, before it is timed: it makes the build's inputs ready (a
        checkpoint fetched only now) and returns the build seconds that went into them (its calibration's), which
        the entry's recorded build time includes. A hit's ``build_seconds`` is that recorded time: what it saved.

        With ``hold``, the result holds the entry (``CacheResult.hold``, for the caller to release): a hit from
        before it is checked, a build or a pull from before it is published, so that no process's eviction takes it
        while the caller still uses it."""
        if validate_key(key) != engine_key(material):
            raise ValueError(f"cache key {key} is not the key of the material given with it (engine_key(material))")
        if not force:
            found, held = self._find_held(key, material, hold)
            if found.hit:
                return self._hit(key, found, False, held)
        self.require_writable(f"{self.label} {key[:12]} cannot be built into the cache")
        with self.key_lock(key, on_wait) as waited:
            found, held = (self._check(key, material), None) if force else self._find_held(key, material, hold)
            if found.hit and not force:
                return self._hit(key, found, waited, held)
            self.sweep(own_key=key)
            if found.reason == "corrupt":
                self.quarantine(key, found.detail)
            damaged: list[str] = []  # a remote copy refused on pull: this build replaces it there
            if not force and (pulled := transfer.try_pull(self, key, material, on_transfer, damaged, hold)):
                return self._remote_hit(pulled, waited)
            lease = nullcontext("none") if self.remote is None or not self.remote.usable \
                else self.remote.lease(self.name, key, on_wait, replacing=force, damaged=bool(damaged))
            with lease as outcome:
                if outcome == "published" and (pulled := transfer.try_pull(self, key, material, on_transfer, damaged,
                                                                           hold)):
                    return self._remote_hit(pulled, waited=True)
                if not force:
                    self._record_lookup(key, found)
                replaced_in_use = force and is_held(self.entry_dir(key))
                entry_dir, seconds, held = self._build_and_publish(key, material, build, describe or {}, prepare, hold)
                try:
                    if self.remote is not None and self.remote.usable:
                        transfer.push_after_build(self, key, force or bool(damaged), on_transfer)
                except BaseException:
                    if held is not None:
                        held.release()
                    raise
        return CacheResult(key, entry_dir, entry_dir / self.payload_name, False, "forced" if force else found.reason,
                           seconds, waited, replaced_in_use, hold=held)

    def _remote_hit(self, pulled: CacheResult, waited: bool) -> CacheResult:
        """A local miss the remote tier served: one lookup, a ``remote hit`` that saved the entry's build time."""
        self.stats.record_lookup(self.name, pulled.key, REMOTE_HIT, pulled.build_seconds)
        return dataclasses.replace(pulled, waited=waited)

    def _hit(self, key: str, found: LookupResult, waited: bool, held: EntryHold | None) -> CacheResult:
        self._record_lookup(key, found)
        return CacheResult(key, found.entry_dir, found.entry_dir / self.payload_name, True, "hit", found.build_seconds,
                           waited, hold=held)

    def is_being_built(self, key: str) -> bool:
        """Whether another builder holds ``key``'s build lock now (a build of it would wait, then reuse its result)."""
        if self.read_only is not None or not self.lock_path(key).exists():  # nothing can be built here, or never was
            return False
        lock = FileLock(self.lock_path(key))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return True
        lock.release()
        return False

    @contextmanager
    def key_lock(self, key: str, on_wait: Callable[[str], None] | None) -> Iterator[bool]:
        """Hold the key's build lock; say so through ``on_wait`` while another process holds it."""
        lock = FileLock(self.lock_path(key))
        waited = False
        started = time.monotonic()
        while True:
            try:
                lock.acquire(timeout=0 if not waited else WAIT_NOTE_EVERY_S)
                break
            except Timeout:
                if on_wait is not None:
                    elapsed = f" ({time.monotonic() - started:.0f} s so far)" if waited else ""
                    on_wait(f"another process is building {self.label} {key[:12]}; waiting for it{elapsed}")
                waited = True
        try:
            yield waited
        finally:
            lock.release()

    def _build_and_publish(self, key: str, material: dict, build: Callable[[Path], dict], describe: dict,
                           prepare: Callable[[], float] | None, hold: bool) -> tuple[Path, float, EntryHold | None]:
        """Build and publish the entry (held from before its publish with ``hold``); its recorded build time is its
        inputs' (``prepare``'s) plus the build's."""
        upstream = prepare() if prepare is not None else 0.0
        started = time.monotonic()

        def fill(tmp: Path) -> dict:
            record = build(tmp / self.payload_name)
            return self._seal(tmp, key, material, record, describe, round(upstream + time.monotonic() - started, 3))

        entry_dir, manifest, held = self.install(key, fill, hold=hold)
        self.stats.record_store(self.name, key, manifest["total_bytes"], manifest["build_seconds"])
        return entry_dir, manifest["build_seconds"], held

    def install(self, key: str, fill: Callable[[Path], dict], *,
                hold: bool = False) -> tuple[Path, dict, EntryHold | None]:
        """Publish what ``fill(tmp_entry_dir) -> manifest`` writes (a payload and its manifest, last) as entry
        ``key``; nothing is left behind when it fails. With ``hold``, the entry is held from before the rename that
        publishes it (the flock stays on its lock file), so that no eviction, which runs after every publish, can
        take it before the caller uses it: the hold is returned, for the caller to release."""
        tmp = self.v1 / "tmp" / f"{self.name}.{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        held = None
        try:
            (tmp / self.payload_name).mkdir(parents=True)
            manifest = fill(tmp)
            held = EntryHold(tmp) if hold else None
            entry_dir = self._publish(tmp, key)
        except BaseException as exc:
            if held is not None:
                held.release()
            shutil.rmtree(tmp, ignore_errors=True)
            if reason := disk_full(exc):
                too_large = reason == os.strerror(errno.EFBIG)
                raise CacheRootError(f"{self.label} {key[:12]}: {'cannot write' if too_large else 'no room to write'} "
                                     f"it under {self.v1.parent} ({reason}){_TOO_LARGE if too_large else _FULL}") \
                    from None
            raise
        # every file was hashed (sealed or checked): "changed" lookups of the entry only stat them until one changes
        payload = entry_dir / self.payload_name
        self.hashes.remember({payload / item["path"]: item["sha256"] for item in manifest["files"]})
        if self._enforce_limits is not None:  # only now: before, it could evict what the build was about to read
            self._enforce_limits(self, key)
        return entry_dir, manifest, held

    def _seal(self, tmp: Path, key: str, material: dict, record: dict, describe: dict, seconds: float) -> dict:
        """fsync every payload file, then write the manifest last; returns the manifest."""
        files = seal_payload(tmp / self.payload_name)
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "store": self.name,
            "key": key,
            "material": material,
            "describe": describe,
            "payload": self.payload_name,
            "files": files,
            "total_bytes": sum(item["size"] for item in files),
            "created": utc_now(),
            "build_seconds": seconds,
            "build": record,
            "builder": {"host": socket.gethostname(), "pid": os.getpid()},
        }
        (tmp / IN_USE_LOCK).touch()
        (tmp / LAST_USED).touch()
        write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
        return manifest

    def _publish(self, tmp: Path, key: str) -> Path:
        """One rename makes the sealed build visible; an existing entry is taken out first (forced rebuild)."""
        final = self.entry_dir(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            trash = self._trash_path(key)
            if take_out(final, trash, even_if_held=True) == "moved":
                delete_unless_held(trash)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        fsync_dir(tmp.parent)
        return final

    # -- the remote tier (transfer.py) -------------------------------------------------------------------------

    def pull(self, key: str, material: dict | None = None, on_transfer: Transferred | None = None, *,
             hold: bool = False) -> CacheResult:
        """Install entry ``key`` from the remote tier, every file checked (``transfer.pull``)."""
        return transfer.pull(self, key, material, on_transfer, hold=hold)

    def push(self, key: str, *, replace: bool = False, on_transfer: Transferred | None = None) -> PushResult:
        """Upload the local entry ``key`` to the remote tier, files first, the manifest last (``transfer.push``)."""
        return transfer.push(self, key, replace=replace, on_transfer=on_transfer)

    def require_remote(self) -> RemoteTier:
        """The remote tier; a usage error saying how to configure one when there is none."""
        if self.remote is None:
            raise CacheUsageError("no remote cache is configured: set cache.remote in the config, or "
                                  "$KILN_CACHE_REMOTE (s3://bucket/prefix or file:///shared/folder)")
        return self.remote

    # -- housekeeping ------------------------------------------------------------------------------------------

    def quarantine(self, key: str, detail: str) -> Path | None:
        """Move a corrupt entry to ``v1/quarantine/`` (kept for inspection until prune); records why."""
        target = self.v1 / "quarantine" / f"{self.name}.{key}.{datetime.now(UTC):%Y%m%dT%H%M%S%fZ}"
        if take_out(self.entry_dir(key), target, even_if_held=True) != "moved":
            return None
        write_atomic(target / "quarantine_reason.txt", (detail + "\n").encode())
        self.stats.record_quarantine(self.name, key, detail)
        return target

    def remove(self, key: str, why: str = "removed") -> int:
        """Remove an entry nobody holds; returns the bytes freed. Raises when absent or in use."""
        outcome, size = self.try_remove(key, why)
        if outcome == "in_use":
            raise CacheEntryInUseError(f"cache key {key}: loaded by a running process; stop it, then retry")
        if outcome == "gone":
            raise CacheEntryNotFoundError(f"cache key {key}: no {self.label} entry; see `kiln cache ls`")
        return size

    def try_remove(self, key: str, why: str) -> tuple[str, int]:
        """Take an entry out unless a process holds it: (``moved``|``in_use``|``gone``, bytes freed)."""
        self.require_writable(f"{self.label} {key[:12]} cannot be removed")
        entry = self.entry_dir(key)
        size = entry_size(entry)
        trash = self._trash_path(key)
        outcome = take_out(entry, trash)
        if outcome == "moved":
            self.stats.record_removal(self.name, key, size, why)
            delete_unless_held(trash)
        return outcome, size if outcome == "moved" else 0

    def sweep(self, own_key: str | None = None, *, dry_run: bool = False) -> dict[Path, int]:
        """Delete this store's stale temporary dirs (their key's build lock is free) and unheld trash; return them
        with their bytes (``dry_run``: the ones it would delete, deleting nothing).

        ``own_key`` is a key whose build lock this process holds: its leftover temporaries are stale too."""
        self.require_writable("temporary builds cannot be swept")
        removed = {}
        for path in sorted((self.v1 / "tmp").iterdir()):
            parts = path.name.split(".")
            if len(parts) == 4 and parts[0] == self.name and is_cache_key(parts[1]):
                if parts[1] == own_key or not self.is_being_built(parts[1]):
                    removed[path] = dir_size(path)
                    if not dry_run:
                        shutil.rmtree(path, ignore_errors=True)
            elif len(parts) == 4 and parts[0] == "trash" and parts[1] == self.name:
                size = dir_size(path)
                if not is_held(path) if dry_run else delete_unless_held(path):
                    removed[path] = size
        return removed

    def _trash_path(self, key: str) -> Path:
        return self.v1 / "tmp" / f"trash.{self.name}.{key}.{uuid.uuid4().hex[:8]}"

    def _touch(self, entry_dir: Path) -> bool:
        """Record a use of the entry (for LRU; not in a read-only cache); False when the entry vanished meanwhile."""
        if self.read_only is not None:
            return entry_dir.is_dir()
        try:
            os.utime(entry_dir / LAST_USED)
        except FileNotFoundError:
            return False
        return True

    def touch(self, key: str) -> bool:
        """Record a use of the entry ``key`` (a load), for LRU eviction."""
        return self._touch(self.entry_dir(key))

    def require_writable(self, what: str) -> None:
        """CacheRootError saying ``what`` cannot be done, and why, in a read-only cache."""
        if self.read_only is not None:
            raise CacheRootError(f"{what}: {self.read_only}")

def utc_now() -> str:
    """The time now as manifests and corruption marks record it (ISO 8601, UTC)."""
    return iso_utc(time.time())


def disk_full(exc: BaseException) -> str | None:
    """Why ``exc``, or an error it was raised from, means the disk or the user's quota is full, or a file outgrew the
    size a process or file system allows (None when not): ENOSPC, EDQUOT or EFBIG, or a writer's error that only says
    so in words (safetensors' "No space left on device", "File too large")."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return os.strerror(exc.errno)
        if isinstance(exc, Exception) and (words := next((w for w in _FULL_WORDS if w in str(exc)), None)):
            return words
        exc = exc.__cause__ or exc.__context__
    return None
