"""What ``kiln cache ls|verify|prune --remote`` report and do on a remote tier, as plain data."""

from __future__ import annotations

import hashlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kiln.engines.cache.manifest import MANIFEST_VERSION
from kiln.engines.cache.remote.layout import (
    LAST_USED,
    MANIFEST,
    REMOTE_STORES,
    VERSION,
    blob_name,
    last_used_name,
    manifest_name,
    parse_entry_name,
    reused_name,
)
from kiln.engines.cache.remote.objects import ObjectInfo
from kiln.engines.cache.remote.tier import RemoteTier, copy_problem, manifest_problem, newer_manifest
from kiln.engines.cache.results import described
from kiln.engines.cache.units import iso_utc, parse_iso

READ_THREADS = 8
PRUNE_GRACE_S = 3600.0  # entries used and blobs written this recently are never pruned (a pull or push in flight)


@dataclass(frozen=True)
class RemoteEntry:
    """An entry of the remote: its manifest (None when unreadable, with ``problem``; ``newer`` when that is a newer
    Kiln's manifest), when it was built (its manifest's ``created``; its push where that is unreadable) and when it
    was last pushed or pulled."""

    store: str
    key: str
    manifest: dict | None
    problem: str | None
    created: float
    last_used: float
    newer: bool = False

    @property
    def size_bytes(self) -> int:
        return sum(item["size"] for item in self.manifest["files"]) if self.manifest else 0

    @property
    def digests(self) -> set[str]:
        """The sha256 of each file it lists: the blobs it keeps (another entry may list some of them too)."""
        return {item["sha256"] for item in self.manifest["files"]} if self.manifest else set()

    def row(self) -> dict:
        describe = (self.manifest or {}).get("describe", {})
        return {"key": self.key, "store": self.store, **described(describe), "size_bytes": self.size_bytes,
                "created": iso_utc(self.created), "last_used": iso_utc(self.last_used), "problem": self.problem}


def remote_entries(tier: RemoteTier) -> list[RemoteEntry]:
    """Every entry with a manifest on the remote, most recently used first (an entry without one does not exist)."""
    objects: dict[tuple[str, str], dict[str, ObjectInfo]] = {}
    for store in REMOTE_STORES:
        for info in tier.objects.list(f"{VERSION}/{store}/"):
            if (parsed := parse_entry_name(info.name)) is not None:
                store, key, file = parsed
                objects.setdefault((store, key), {})[file] = info
    found = [(store, key, files) for (store, key), files in objects.items() if MANIFEST in files]

    def read(item: tuple[str, str, dict[str, ObjectInfo]]) -> RemoteEntry:
        store, key, files = item
        found = tier.stored_manifest(store, key)
        stored = found[0] if found else None
        problem = _problem(stored, store, key) if found else "manifest removed meanwhile"
        manifest = None if problem else stored
        pushed = files[MANIFEST].modified
        created = parse_iso((manifest or {}).get("created")) or pushed  # when it was built, as `kiln cache ls` says
        last_used = max(pushed, files[LAST_USED].modified if LAST_USED in files else pushed)
        return RemoteEntry(store, key, manifest, problem, created, last_used, newer_manifest(stored))

    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        entries = list(pool.map(read, found))
    return sorted(entries, key=lambda entry: -entry.last_used)


def _problem(manifest: object, store: str, key: str) -> str | None:
    """Why a stored manifest is not entry ``key``'s to use here (None when it is)."""
    if newer_manifest(manifest):
        return (f"manifest version {manifest['manifest_version']}, this Kiln reads {MANIFEST_VERSION}: a newer "
                f"Kiln's entry")
    return manifest_problem(manifest, store, key, None)


def verify_remote(tier: RemoteTier, entries: list[RemoteEntry] | None = None) -> list[dict]:
    """Read back every file of these remote entries (default: all) and check its size and sha256 against the
    manifest, without a local copy; each result names its bad files (``problems``). A newer Kiln's entry is not this
    one's to judge: ``incompatible`` says so, and it is neither read nor counted a problem, as a local one."""
    results = []
    entries = remote_entries(tier) if entries is None else entries
    for entry in entries:
        if entry.newer:
            results.append({"key": entry.key, "store": entry.store, "ok": True, "files_checked": 0, "problems": [],
                            "incompatible": f"{entry.problem}, not this Kiln's to check; left as it is"})
            continue
        problems = [] if entry.manifest else [entry.problem]
        files = entry.manifest["files"] if entry.manifest else []
        with ThreadPoolExecutor(max_workers=tier.file_threads) as pool:
            problems += [p for p in pool.map(lambda item: _file_problem(tier, item), files) if p]
        results.append({"key": entry.key, "store": entry.store, "ok": not problems, "files_checked": len(files),
                        "problems": problems})
    return results


def _file_problem(tier: RemoteTier, item: dict) -> str | None:
    chunks = tier.objects.chunks(blob_name(item["sha256"]))
    if chunks is None:
        return f"{item['path']}: missing on the remote"
    digest, size = hashlib.sha256(), 0
    for chunk in chunks:
        digest.update(chunk)
        size += len(chunk)
    return copy_problem(item, size, digest.hexdigest())


def stored_blobs(tier: RemoteTier) -> dict[str, ObjectInfo]:
    """Every file the remote stores, by its sha256: each once, however many entries list it."""
    return {info.name.rsplit("/", 1)[-1]: info for info in tier.objects.list(f"{VERSION}/blobs/")}


def prune_remote(tier: RemoteTier, *, older_than_s: float | None, max_size_bytes: int | None,
                 dry_run: bool = False, grace_s: float = PRUNE_GRACE_S) -> dict:
    """Remove entries not used for ``older_than_s``, then least recently used ones until the files stored fit
    ``max_size_bytes`` (``_over_size``); never one used within ``grace_s`` (a machine may be pulling it: a pull marks
    the entry used as it starts), nor one used since it was listed (``_remove``). Then delete the files no remaining
    manifest lists, once older than ``grace_s`` and not reused within it (younger ones may belong to a push in
    flight, and so may those a push marked reused: ``_reused``), the writes begun before that which never finished
    (a push killed half way), stale build leases and reuse marks. Entries whose manifest is damaged are removed too,
    once unused for ``grace_s``. A newer Kiln's entries are left alone, and while there are any no file is deleted:
    which files they list is for that Kiln to say. ``freed_bytes`` counts the files deleted (a dry run: that would
    be), ``stored_bytes`` the files stored after."""
    now = tier.objects.now()
    entries = remote_entries(tier)
    blobs = stored_blobs(tier)
    newer = [entry for entry in entries if entry.newer]
    removed = [e for e in entries if e.manifest is None and not e.newer and now - e.last_used >= grace_s]
    kept = [entry for entry in entries if entry.manifest is not None]
    if older_than_s is not None:
        removed += [e for e in kept if now - e.last_used >= max(older_than_s, grace_s)]
        kept = [e for e in kept if e not in removed]
    if max_size_bytes is not None:
        removed += _over_size(kept, blobs, max_size_bytes, now - grace_s)
        kept = [e for e in kept if e not in removed]
    if not dry_run:
        removed = [entry for entry in removed if _remove(tier, entry)]
    listed = {digest for entry in entries if entry not in removed for digest in entry.digests}
    orphans = []
    for digest, info in [] if newer else blobs.items():
        if digest in listed or now - info.modified < grace_s or _reused(tier, digest, now - grace_s):
            continue
        if not dry_run:  # right after its reuse mark was read: a push that marks it later finds it gone
            tier.objects.delete(info.name, if_tag=info.etag)
        orphans.append(info)
    leases = [info for info in tier.objects.list(f"{VERSION}/leases/") if now - info.modified > tier.timing.stale_s]
    marks = [info for info in tier.objects.list(f"{VERSION}/reused/") if info.modified < now - grace_s]
    unfinished = tier.objects.discard_unfinished(now - grace_s, dry_run=dry_run)
    if not dry_run:
        for info in leases + marks:
            tier.objects.delete(info.name, if_tag=info.etag)
    freed = sum(info.size for info in orphans)
    return {
        "dry_run": dry_run,
        "remote": tier.url,
        "removed": [{"key": e.key, "store": e.store, "size_bytes": e.size_bytes, "last_used": iso_utc(e.last_used),
                     "problem": e.problem} for e in removed],
        "kept": len(entries) - len(removed),
        "newer_entries": len(newer),
        "files_removed": len(orphans),
        "freed_bytes": freed,
        "stored_bytes": sum(info.size for info in blobs.values()) - freed,
        "stale_leases_removed": len(leases),
        "unfinished_writes_removed": unfinished,
    }


def _remove(tier: RemoteTier, entry: RemoteEntry) -> bool:
    """Delete the entry's manifest (from then on nobody pulls it), then its last use; unless a pull or push used it
    since ``remote_entries`` listed it (a pull marks it used before it reads a file): False then, and it is kept."""
    names = (manifest_name(entry.store, entry.key), last_used_name(entry.store, entry.key))
    if any(info is not None and info.modified > entry.last_used for info in map(tier.objects.stat, names)):
        return False
    for name in names:
        tier.objects.delete(name)
    return True


def _reused(tier: RemoteTier, digest: str, since: float) -> bool:
    """Whether a push marked stored file ``digest`` reused since ``since`` (the store's clock): the manifest that
    lists it may be written after this prune read the manifests."""
    mark = tier.objects.stat(reused_name(digest))
    return mark is not None and mark.modified >= since


def _over_size(kept: list[RemoteEntry], blobs: dict[str, ObjectInfo], max_size_bytes: int,
               unused_since: float) -> list[RemoteEntry]:
    """The least recently used of ``kept`` (only those unused since ``unused_since``) to remove until the files
    stored fit ``max_size_bytes``: each file the rest list, once however many list it, plus the unlisted files written
    since ``unused_since`` (a push in flight's, which a prune leaves). Removing an entry frees only the files no other
    kept entry lists; older unlisted files are not counted: a prune deletes them (or, while a newer Kiln's entries
    are there, they may be that Kiln's)."""
    users = Counter(digest for entry in kept for digest in entry.digests)
    total = sum(info.size for digest, info in blobs.items() if digest in users or info.modified > unused_since)
    removed = []
    for entry in sorted(kept, key=lambda e: e.last_used):  # least recently used first
        if total <= max_size_bytes:
            break
        if entry.last_used > unused_since:
            continue
        removed.append(entry)
        users.subtract(entry.digests)
        total -= sum(blobs[d].size for d in entry.digests
                     if users[d] == 0 and d in blobs and blobs[d].modified <= unused_since)
    return removed
