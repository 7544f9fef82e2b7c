"""The remote tier of an engine cache: pull an entry (every file checked against its manifest's sha256), push one
(files first, the manifest last), and the build lease that keeps machines from building one key twice."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from pathlib import Path

from kiln.engines.cache.hashing import file_sha256
from kiln.engines.cache.keys import canonical_json, engine_key
from kiln.engines.cache.manifest import (  # the remote stores local manifests as they are
    MANIFEST_VERSION,
    safe_relpath,
    total_problem,
)
from kiln.engines.cache.remote.layout import blob_name, last_used_name, manifest_name, reused_name
from kiln.engines.cache.remote.lease import LeaseOutcome, LeaseTiming, build_lease
from kiln.engines.cache.remote.objects import ObjectStore, RemoteCorruptError, RemoteUnavailableError
from kiln.engines.cache.remote.spec import RemoteSpec, open_objects

Transferred = Callable[[str, int, int], None]  # told ("pull" or "push", bytes moved so far, bytes in all)


class TransferStopped(Exception):
    """Raised in a file transfer's progress report once its push or pull was given up (Ctrl-C, another file's
    failure): the transfer stops at its next chunk instead of running to its end."""


@dataclass(frozen=True)
class PullResult:
    """A remote entry written into a local folder: its manifest (bytes as stored), bytes moved and seconds."""

    manifest: dict
    raw_manifest: bytes
    bytes: int
    seconds: float


@dataclass(frozen=True)
class PushResult:
    """``outcome``: ``pushed``, or ``present`` when the remote already had the entry; bytes uploaded, seconds."""

    outcome: str
    bytes: int
    seconds: float
    files_uploaded: int


class RemoteTier:
    """The remote of one cache root. ``warn`` hears what went wrong when the build goes on without the remote."""

    def __init__(self, spec: RemoteSpec, objects: ObjectStore | None = None, *, file_threads: int = 4,
                 timing: LeaseTiming | None = None, warn: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        if objects is not None:
            self.objects = objects
        self.url, self.required = spec.url.rstrip("/"), spec.required
        self.file_threads = file_threads
        self.timing = timing or LeaseTiming()
        self.warn = warn or (lambda message: None)
        self.unreachable: str | None = None  # why the remote failed in this process, which then goes on without it

    @property
    def usable(self) -> bool:
        """False once a request failed (``failed``): the rest of the run leaves the remote alone."""
        return self.unreachable is None

    def failed(self, exc: RemoteUnavailableError) -> None:
        """A request to the remote failed: an error when the remote is required; else one warning, and the rest of
        this process goes on without the remote (builds stay local, nothing is lost)."""
        if self.required:
            raise RemoteUnavailableError(f"{exc} (cache.remote_required is set)") from None
        if self.unreachable is None:
            self.unreachable = str(exc)
            self.warn(f"{exc}; going on without the remote cache in this run: builds are local, and `kiln cache "
                      f"push --all` uploads them later")

    @functools.cached_property
    def objects(self) -> ObjectStore:
        """The object store, opened on first use (a cache command that never asks the remote makes no client)."""
        return open_objects(self.spec)

    # -- reading -----------------------------------------------------------------------------------------------

    def has(self, store: str, key: str) -> bool:
        """Whether the remote has entry ``key`` of ``store`` (its manifest exists; a pull still checks it)."""
        return self.objects.stat(manifest_name(store, key)) is not None

    def manifest(self, store: str, key: str, material: dict | None = None) -> tuple[dict, bytes] | None:
        """The entry's manifest (parsed, and as stored), None when the remote has no such entry; a manifest that
        is not this entry's whole, well-formed record raises RemoteCorruptError."""
        found = self.stored_manifest(store, key)
        if found is None:
            return None
        manifest, raw = found
        problem = manifest_problem(manifest, store, key, material)
        if problem:
            raise RemoteCorruptError(f"remote cache {self.url}: {store} {key[:12]}: {problem}; the entry is refused")
        return manifest, raw

    def stored_manifest(self, store: str, key: str) -> tuple[object, bytes] | None:
        """The entry's manifest as stored, unchecked: parsed (None when not JSON) and raw; None when there is none."""
        raw = self.objects.read(manifest_name(store, key))
        if raw is None:
            return None
        try:
            return json.loads(raw), raw
        except ValueError:
            return None, raw

    def pull(self, store: str, key: str, material: dict | None, payload: Path,
             transferred: Transferred | None = None) -> PullResult | None:
        """Download the entry's files into ``payload`` and check each one's size and sha256 against the manifest;
        None when the remote has no such entry, or no longer has it once they are read (a ``prune --remote``
        removed it meanwhile). A missing or altered file raises RemoteCorruptError naming it (``payload`` then holds
        partial files: the caller discards it). The entry is marked used before its files are read, so that a
        prune's grace covers the pull in progress, and again once they are."""
        found = self.manifest(store, key, material)
        if found is None:
            return None
        manifest, raw = found
        self.mark_used(store, key)
        started = time.monotonic()
        files = manifest["files"]
        counter = _Counter("pull", sum(item["size"] for item in files), transferred)

        def fetch(item: dict) -> str | None:
            target = payload / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            if not self.objects.download(blob_name(item["sha256"]), target, counter.add):
                return f"{item['path']}: missing on the remote (blob {item['sha256'][:12]})"
            size = target.stat().st_size
            return copy_problem(item, size, file_sha256(target) if size == item["size"] else "")

        problems = [p for p in self._each(fetch, files, counter) if p]
        if problems:
            if not self.has(store, key):  # a prune removed it meanwhile: a miss, not damage
                return None
            raise RemoteCorruptError(f"remote cache {self.url}: {store} {key[:12]} refused: " + "; ".join(problems))
        self.mark_used(store, key)
        return PullResult(manifest, raw, counter.done, round(time.monotonic() - started, 3))

    # -- writing -----------------------------------------------------------------------------------------------

    def push(self, store: str, key: str, entry_dir: Path, payload_name: str, manifest_bytes: bytes, *,
             replace: bool = False, transferred: Transferred | None = None) -> PushResult:
        """Upload a local entry: each file not already stored under its digest, then the manifest, then any file
        that went missing meanwhile (a ``prune --remote`` may delete files no manifest listed yet). A file already
        stored is given a reuse mark instead, which keeps it from a prune that read the manifests before this one's.
        An entry the remote already has (a valid manifest whose files are all there) is left as it is unless
        ``replace`` (a forced rebuild, or a remote copy found damaged), which uploads every file again."""
        started = time.monotonic()
        manifest = json.loads(manifest_bytes)
        files = manifest["files"]
        if not replace:
            try:
                present = self.manifest(store, key) is not None and not self._missing(files)
            except RemoteCorruptError:
                present = False  # replaced by this push
            if present:
                self.mark_used(store, key)
                return PushResult("present", 0, round(time.monotonic() - started, 3), 0)
        counter = _Counter("push", sum(item["size"] for item in files), transferred)
        mark = f"{store} {key} {time.time()}".encode()  # unique: a prune deletes a stale mark only if unchanged

        def upload(item: dict) -> bool:
            name = blob_name(item["sha256"])
            stored = None if replace else self.objects.stat(name)
            if stored is not None and stored.size == item["size"]:
                self.objects.write(reused_name(item["sha256"]), mark)
                counter.add(item["size"])
                return False
            self.objects.upload(name, entry_dir / payload_name / item["path"], counter.add)
            return True

        uploaded = sum(self._each(upload, files, counter))
        self.objects.write(manifest_name(store, key), manifest_bytes)  # the entry exists from here on
        # its files are listed now: no prune takes them
        uploaded += sum(self._each(upload, self._missing(files), counter))
        self.mark_used(store, key)
        return PushResult("pushed", counter.done, round(time.monotonic() - started, 3), uploaded)

    def _missing(self, files: list[dict]) -> list[dict]:
        """The manifest entries of ``files`` whose blob is not stored at its size (a stat each: an entry has a few)."""
        stats = [self.objects.stat(blob_name(item["sha256"])) for item in files]
        return [item for item, stored in zip(files, stats, strict=True)
                if stored is None or stored.size != item["size"]]

    def mark_used(self, store: str, key: str) -> None:
        """Record a use of the entry on the remote (for ``prune --remote``); a failure only costs that record."""
        with suppress(RemoteUnavailableError):
            self.objects.write(last_used_name(store, key), b"")

    def lease(self, store: str, key: str, on_wait: Callable[[str], None] | None,
              replacing: bool = False, damaged: bool = False) -> AbstractContextManager[LeaseOutcome]:
        """The remote build lease of ``key`` (``lease.build_lease``)."""
        return build_lease(self.objects, store, key, timing=self.timing, on_wait=on_wait, failed=self.failed,
                           replacing=replacing, damaged=damaged)

    def _each(self, work: Callable[[dict], object], files: list[dict], counter: _Counter) -> list:
        """``work``'s result on each file, ``file_threads`` at once, largest first (so the big ones overlap). When
        one fails or the caller is interrupted, the transfers still running stop at their next chunk
        (``counter.stop``): all the waiting happens here, so a Ctrl-C lands inside this ``try`` wherever it comes
        (a generator suspended in its caller's frame stopped them only once it was collected)."""
        ordered = sorted(files, key=lambda item: -item["size"])
        pool = ThreadPoolExecutor(max_workers=self.file_threads, thread_name_prefix="kiln-remote")
        try:
            return list(pool.map(work, ordered))
        except BaseException:
            counter.stop()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


class _Counter:
    """Bytes moved by several threads, reported as a running total."""

    def __init__(self, verb: str, total: int, transferred: Transferred | None) -> None:
        self.verb, self.total, self.done, self._transferred = verb, total, 0, transferred
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Make every transfer still reporting to this counter raise TransferStopped at its next chunk."""
        self._stopped.set()

    def add(self, n: int) -> None:
        if self._stopped.is_set():
            raise TransferStopped(f"{self.verb} given up")
        with self._lock:
            self.done += n
            done = self.done
        if self._transferred is not None:
            self._transferred(self.verb, done, self.total)


def manifest_problem(manifest: object, store: str, key: str, material: dict | None) -> str | None:
    """Why a remote manifest is not a whole record of entry ``key`` of ``store`` (None when it is): its version,
    store, key, key material (hashing to the key, and equal to ``material`` when given) and file list."""
    if not isinstance(manifest, dict):
        return "manifest.json is not a JSON object"
    if manifest.get("manifest_version") != MANIFEST_VERSION or manifest.get("store") != store:
        return f"manifest version {manifest.get('manifest_version')!r} of store {manifest.get('store')!r}"
    if manifest.get("key") != key:
        return f"the manifest names key {manifest.get('key')!r}"
    stored = manifest.get("material")
    if not isinstance(stored, dict) or engine_key(stored) != key:
        return "its key material does not hash to the key"
    if material is not None and canonical_json(material) != canonical_json(stored):
        return "its key material differs from this build's"
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        return "no file list"
    for item in files:
        if not (isinstance(item, dict) and safe_relpath(item.get("path")) and isinstance(item.get("size"), int)
                and isinstance(item.get("sha256"), str) and len(item["sha256"]) == 64
                and set(item["sha256"]) <= set("0123456789abcdef")):
            return f"a malformed file record {item!r}"
    if len({item["path"] for item in files}) != len(files):
        return "a file listed twice"
    return total_problem(manifest)


def newer_manifest(manifest: object) -> bool:
    """Whether a manifest is of a later version than this Kiln's: a newer Kiln's record, not this one's to judge."""
    version = manifest.get("manifest_version") if isinstance(manifest, dict) else None
    return isinstance(version, int) and version > MANIFEST_VERSION


def copy_problem(item: dict, size: int, sha256: str) -> str | None:
    """What is wrong with the remote copy of a manifest's file record ``item``, of ``size`` bytes and this sha256
    (None when it is the file the manifest lists)."""
    if size != item["size"]:
        return f"{item['path']}: {size} bytes on the remote, the manifest says {item['size']}"
    if sha256 != item["sha256"]:
        return f"{item['path']}: sha256 differs from the manifest (the remote copy is altered)"
    return None
