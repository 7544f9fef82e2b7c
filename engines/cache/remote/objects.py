"""What the remote tier needs of an object store: named byte objects, listed by prefix, written whole.

Two stores implement it: ``s3.py`` (any S3-compatible service, through boto3) and ``filesystem.py`` (a folder on a
shared filesystem, ``file://``). Names are ``/``-separated and relative to the remote's prefix."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kiln.runtime.errors import KilnError

Progress = Callable[[int], None]  # told the bytes moved since its last call


class RemoteUnavailableError(KilnError):
    """The remote cache could not be reached or refused the request (network, credentials, bucket, permissions)."""


class RemoteCorruptError(KilnError):
    """A remote entry whose manifest or files do not hold what they should; it is never installed."""

    exit_code = 3


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its name under the remote's prefix, size, last modification (epoch seconds) and a tag
    that changes whenever its content is replaced (an ETag)."""

    name: str
    size: int
    modified: float
    etag: str


class ObjectStore(Protocol):
    """A bucket prefix or a shared folder. Every method raises RemoteUnavailableError when the store cannot be
    reached; a missing object is ``None``, never an error."""

    url: str  # what to show a person: the remote's URL, never its credentials

    def read(self, name: str) -> bytes | None:
        """The whole object, or None when it does not exist."""

    def stat(self, name: str) -> ObjectInfo | None:
        """The object's size, time and tag, or None when it does not exist."""

    def write(self, name: str, data: bytes, *, if_absent: bool = False, if_tag: str | None = None) -> bool:
        """Replace the object whole; ``if_absent``: only if it does not exist yet, ``if_tag``: only if its tag is
        still this one. False when such a condition did not hold (nothing was written)."""

    def upload(self, name: str, path: Path, progress: Progress) -> None:
        """Store a local file as the object (multipart and parallel where the store has it); the object appears
        whole or not at all."""

    def download(self, name: str, path: Path, progress: Progress) -> bool:
        """Write the object to a local file (parallel ranges where the store has them); False when it does not
        exist."""

    def chunks(self, name: str) -> Iterator[bytes] | None:
        """The object's bytes in order (for hashing without a local copy), or None when it does not exist."""

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose name starts with ``prefix``."""

    def delete(self, name: str, *, if_tag: str | None = None) -> None:
        """Remove the object (nothing when it is already gone); ``if_tag``: only while its tag is this one."""

    def discard_unfinished(self, started_before: float, *, dry_run: bool = False) -> int:
        """Discard the writes begun before ``started_before`` (the store's clock) that never finished (a writer
        killed half way: a temporary file, an incomplete multipart upload); how many there were."""

    def now(self) -> float:
        """The store's clock (epoch seconds), against which ``ObjectInfo.modified`` is compared."""
