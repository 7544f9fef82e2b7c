"""Moving entries between a local ``ContentStore`` and its remote tier: ``pull`` (every file checked against its
sha256, then published locally, manifest last), ``push`` (files first, the manifest last), and what a build does
around them (``try_pull`` before it, ``push_after_build`` after)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.engines.cache.errors import CacheCorruptError, CacheEntryNotFoundError
from kiln.engines.cache.in_use import EntryHold
from kiln.engines.cache.layout import LAST_USED, MANIFEST, write_atomic
from kiln.engines.cache.manifest import file_problems, manifest_mismatch
from kiln.engines.cache.remote.objects import RemoteCorruptError, RemoteUnavailableError
from kiln.engines.cache.remote.tier import PushResult, Transferred
from kiln.engines.cache.results import CacheResult, recorded_build_seconds
from kiln.engines.cache.stats import REMOTE_HIT
from kiln.runtime.cache_hold import IN_USE_LOCK

if TYPE_CHECKING:
    from kiln.engines.cache.store import ContentStore


def pull(store: ContentStore, key: str, material: dict | None = None, on_transfer: Transferred | None = None, *,
         hold: bool = False) -> CacheResult:
    """Install entry ``key`` from the remote tier (every file checked against its sha256 before the local
    publish); CacheEntryNotFoundError when the remote does not have it, RemoteCorruptError when its copy is
    damaged (nothing is installed). With ``hold``, the result holds the entry from before it is published (no
    other process's eviction takes it before this one loads it)."""
    remote = store.require_remote()
    store.require_writable(f"{store.label} {key[:12]} cannot be pulled into the cache")
    with store.key_lock(key, None):
        store.sweep(own_key=key)  # what a pull killed half-way left behind
        found = store.lookup(key, material, record=False)
        if found.hit:
            return CacheResult(key, found.entry_dir, found.entry_dir / store.payload_name, True, "hit",
                               found.build_seconds, False, hold=EntryHold(found.entry_dir) if hold else None)
        if found.reason == "corrupt":
            store.quarantine(key, found.detail)
        result = _pull_and_install(store, key, material, on_transfer, hold)
    if result is None:
        raise CacheEntryNotFoundError(f"cache key {key}: no {store.label} entry on {remote.url}; see "
                                      f"`kiln cache ls --remote`")
    return result


def push(store: ContentStore, key: str, *, replace: bool = False,
         on_transfer: Transferred | None = None) -> PushResult:
    """Upload the local entry ``key`` to the remote tier (files first, the manifest last); an entry that ``kiln
    cache verify`` calls damaged (a manifest of another key, key material that does not hash to the key, files that
    no longer match the manifest) is refused (CacheCorruptError)."""
    remote = store.require_remote()
    manifest = store.read_manifest(key)
    entry = store.entry_dir(key)
    if (mismatch := manifest_mismatch(manifest, store.name, key)) is not None:  # what verify and a lookup refuse
        problems = [f"{entry / MANIFEST}: {mismatch[1]}"]
    else:
        problems = file_problems(entry, store.payload_name, manifest, digest=store.hashes.sha256, first_only=True)
    if problems:
        raise CacheCorruptError(f"cache key {key}: not pushed, the local entry is damaged ({problems[0]}); run "
                                f"`kiln cache verify {key}`")
    started = time.monotonic()
    try:
        result = remote.push(store.name, key, entry, store.payload_name, (entry / MANIFEST).read_bytes(),
                             replace=replace, transferred=on_transfer)
    except RemoteUnavailableError as exc:
        store.stats.record_remote(store.name, key, "push", "error", time.monotonic() - started, 0, str(exc))
        raise
    store.stats.record_remote(store.name, key, "push", result.outcome, result.seconds, result.bytes)
    return result


def try_pull(store: ContentStore, key: str, material: dict, on_transfer: Transferred | None,
             damaged: list[str], hold: bool = False) -> CacheResult | None:
    """``_pull_and_install`` inside a build: a damaged remote entry is reported (and added to ``damaged``) and
    built over, an unreachable remote warned about once (an error when the remote is required)."""
    if store.remote is None or not store.remote.usable:
        return None
    try:
        return _pull_and_install(store, key, material, on_transfer, hold)
    except RemoteCorruptError as exc:
        damaged.append(str(exc))
        store.remote.warn(f"{exc}; building it here and pushing a good copy")
    except RemoteUnavailableError as exc:
        store.remote.failed(exc)
    return None


def push_after_build(store: ContentStore, key: str, force: bool, on_transfer: Transferred | None) -> None:
    """Push a new build; an unreachable remote is reported, the local entry kept."""
    try:
        push(store, key, replace=force, on_transfer=on_transfer)
    except RemoteUnavailableError as exc:
        store.remote.failed(exc)  # the local entry is kept either way


def _pull_and_install(store: ContentStore, key: str, material: dict | None, on_transfer: Transferred | None,
                      hold: bool = False) -> CacheResult | None:
    """Pull entry ``key`` into a temporary folder and publish it locally (held from before the publish with
    ``hold``); None when the remote lacks it. Failures are recorded and raised."""
    remote = store.require_remote()
    started = time.monotonic()
    pulled = []

    def fill(tmp: Path) -> dict:
        result = remote.pull(store.name, key, material, tmp / store.payload_name, on_transfer)
        if result is None:
            raise CacheEntryNotFoundError(key)
        if store.payload_problem is not None and (problem := store.payload_problem(tmp / store.payload_name)):
            raise RemoteCorruptError(f"{store.label} {key[:12]} on {remote.url}: {problem}; it is not installed "
                                     f"(`kiln cache prune --remote` removes it)")
        (tmp / IN_USE_LOCK).touch()
        (tmp / LAST_USED).touch()
        write_atomic(tmp / MANIFEST, result.raw_manifest)
        pulled.append(result)
        return result.manifest

    try:
        entry_dir, manifest, held = store.install(key, fill, hold=hold)
    except CacheEntryNotFoundError:
        store.stats.record_remote(store.name, key, "pull", "miss", time.monotonic() - started)
        return None
    except (RemoteCorruptError, RemoteUnavailableError) as exc:
        outcome = "corrupt" if isinstance(exc, RemoteCorruptError) else "error"
        store.stats.record_remote(store.name, key, "pull", outcome, time.monotonic() - started, 0, str(exc))
        raise
    result = pulled[0]
    store.stats.record_remote(store.name, key, "pull", "hit", result.seconds, result.bytes)
    return CacheResult(key, entry_dir, entry_dir / store.payload_name, True, REMOTE_HIT,
                       recorded_build_seconds(manifest), False, pulled=True, hold=held)
