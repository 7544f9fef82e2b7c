"""A folder on a shared filesystem (NFS, Lustre, a mounted volume) as the remote tier's object store: ``file://``.

An object is a file written through a temporary sibling and renamed into place, so it appears whole or not at all;
``if_absent`` writes link the finished temporary to the name, which fails when the name exists. The folder must
exist: a shared filesystem that is not mounted is an error, never a local folder created in its place."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from kiln.engines.cache.remote.objects import ObjectInfo, Progress, RemoteUnavailableError

CHUNK_BYTES = 8 * 2**20
TEMPORARY = ".partial-"  # the prefix of a file being written; never listed


class FileObjects:
    """The objects under a folder; an object's tag is its inode, size and modification time."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"

    def _path(self, name: str) -> Path:
        self._require_root()
        return self.root / name

    def _require_root(self) -> None:
        if not self.root.is_dir():
            raise RemoteUnavailableError(f"remote cache {self.url}: no such folder (is the shared filesystem "
                                         f"mounted?); create it to start a remote cache there")

    def _fail(self, what: str, name: str, exc: OSError) -> RemoteUnavailableError:
        return RemoteUnavailableError(f"remote cache {self.url}: {what} {name} failed ({exc.strerror or exc})")

    @staticmethod
    def _info(name: str, st: os.stat_result) -> ObjectInfo:
        return ObjectInfo(name, st.st_size, st.st_mtime, f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}")

    def _temporary(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.with_name(f"{TEMPORARY}{path.name}.{uuid.uuid4().hex[:8]}")

    def read(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._fail("reading", name, exc) from None

    def stat(self, name: str) -> ObjectInfo | None:
        try:
            return self._info(name, self._path(name).stat())
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._fail("looking up", name, exc) from None

    def write(self, name: str, data: bytes, *, if_absent: bool = False, if_tag: str | None = None) -> bool:
        path = self._path(name)
        try:
            tmp = self._temporary(path)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                if if_absent:
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        return False
                else:
                    current = self.stat(name)
                    if if_tag is not None and (current is None or current.etag != if_tag):
                        return False
                    os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise self._fail("writing", name, exc) from None
        return True

    def upload(self, name: str, path: Path, progress: Progress) -> None:
        target = self._path(name)
        try:
            tmp = self._temporary(target)
            try:
                _copy(path, tmp, progress)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise self._fail("uploading", name, exc) from None

    def download(self, name: str, path: Path, progress: Progress) -> bool:
        source = self._path(name)
        if not source.is_file():
            return False
        try:
            _copy(source, path, progress)
        except OSError as exc:
            raise self._fail("downloading", name, exc) from None
        return True

    def chunks(self, name: str) -> Iterator[bytes] | None:
        try:
            f = open(self._path(name), "rb")  # noqa: SIM115 (closed by the generator)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._fail("reading", name, exc) from None

        def read() -> Iterator[bytes]:
            with f:
                while chunk := self._read_chunk(f, name):
                    yield chunk
        return read()

    def _read_chunk(self, f: BinaryIO, name: str) -> bytes:
        try:
            return f.read(CHUNK_BYTES)
        except OSError as exc:
            raise self._fail("reading", name, exc) from None

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self._require_root()
        start = self.root / prefix.rpartition("/")[0]
        for dirpath, _, filenames in os.walk(start, onerror=self._unlisted):
            for filename in filenames:
                path = Path(dirpath) / filename
                name = path.relative_to(self.root).as_posix()
                if filename.startswith(TEMPORARY) or not name.startswith(prefix):
                    continue
                try:
                    yield self._info(name, path.stat())
                except FileNotFoundError:
                    continue

    def _unlisted(self, exc: OSError) -> None:
        """A folder ``list`` could not read: an error (a listing that skipped it would make its objects look gone),
        unless the folder itself is gone."""
        if not isinstance(exc, FileNotFoundError):
            name = Path(exc.filename).relative_to(self.root).as_posix() if exc.filename else "(all)"
            raise self._fail("listing", name, exc)

    def delete(self, name: str, *, if_tag: str | None = None) -> None:
        current = self.stat(name)
        if current is None or (if_tag is not None and current.etag != if_tag):
            return
        try:
            self._path(name).unlink(missing_ok=True)
        except OSError as exc:
            raise self._fail("deleting", name, exc) from None

    def discard_unfinished(self, started_before: float, *, dry_run: bool = False) -> int:
        self._require_root()
        stale = [Path(dirpath) / name for dirpath, _, filenames in os.walk(self.root) for name in filenames
                 if name.startswith(TEMPORARY)]
        stale = [path for path in stale if _modified(path) < started_before]
        if not dry_run:
            for path in stale:
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    raise self._fail("deleting", path.relative_to(self.root).as_posix(), exc) from None
        return len(stale)

    def now(self) -> float:
        return time.time()


def _modified(path: Path) -> float:
    """``path``'s modification time; infinite once it is gone (a write that finished meanwhile)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _copy(source: Path, target: Path, progress: Progress) -> None:
    """Copy a file, fsync'ed, telling ``progress`` each chunk's bytes."""
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(CHUNK_BYTES):
            dst.write(chunk)
            progress(len(chunk))
        dst.flush()
        os.fsync(dst.fileno())
