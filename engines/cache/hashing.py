"""Content hashes: sha256 of a file, and the Merkle hash of a checkpoint memoised per (path, size, mtime, inode)."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from kiln.engines.cache.db import connect, ensure_schema
from kiln.engines.cache.errors import CheckpointHashError

WEIGHT_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONFIG_SUFFIXES = (".json",)
TOKENIZER_SUFFIXES = (".tiktoken",)
TOKENIZER_NAMES = frozenset({"tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "merges.txt", "vocab.txt"})

_MEMO_SCHEMA = ("CREATE TABLE IF NOT EXISTS file_hash (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, "
                "inode INTEGER, sha256 TEXT)",)

_memo: dict[tuple[str, int, int, int], str] = {}
_memo_lock = threading.Lock()


def file_sha256(path: Path) -> str:
    """sha256 hex of a file's bytes, streamed."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of a checkpoint that its content hash covers, and the pickle files it lists but never reads."""

    root: Path
    hashed: list[str]
    pickles: list[str]


def checkpoint_files(path: Path) -> CheckpointFiles:
    """Weight (*.safetensors), config (*.json) and tokenizer files under ``path``, hidden folders skipped.

    Pickle weights (*.bin, *.pt, ...) are only listed: a checkpoint whose weights are all pickles is refused. Links
    are followed, each folder once (a ``loop -> .`` link adds nothing), and a file that is not a regular file once
    its links are resolved (a device such as /dev/zero, a FIFO, a dangling or looping link) is refused by name."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointHashError(f"checkpoint {root}: not a directory (or a link that does not resolve to one); "
                                  f"point model.path at the checkpoint folder")
    hashed, pickles = [], []
    seen = {os.path.realpath(root)}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        kept = []
        for name in sorted(dirnames):
            real = os.path.realpath(os.path.join(dirpath, name))
            if not name.startswith(".") and real not in seen:
                seen.add(real)
                kept.append(name)
        dirnames[:] = kept
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if name.startswith("."):
                continue
            if name.endswith(PICKLE_SUFFIXES):
                pickles.append(rel)
            elif name.endswith(WEIGHT_SUFFIXES + CONFIG_SUFFIXES + TOKENIZER_SUFFIXES) or name in TOKENIZER_NAMES:
                _require_regular_file(root, rel)
                hashed.append(rel)
    if not any(rel.endswith(WEIGHT_SUFFIXES) for rel in hashed):
        if pickles:
            raise CheckpointHashError(
                f"checkpoint {root}: only pickle weights ({', '.join(sorted(pickles))}); Kiln never unpickles, "
                "convert the checkpoint to safetensors")
        raise CheckpointHashError(f"checkpoint {root}: no *.safetensors weight files found")
    return CheckpointFiles(root=root, hashed=sorted(hashed), pickles=sorted(pickles))


def _require_regular_file(root: Path, rel: str) -> None:
    """Refuse, by name, a checkpoint file that is not a regular file once its links are resolved."""
    try:
        mode = os.stat(root / rel).st_mode
    except OSError as exc:
        raise CheckpointHashError(f"checkpoint {root}: {rel} cannot be read ({exc.strerror}: a dangling or looping "
                                  f"link?)") from None
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
        raise CheckpointHashError(f"checkpoint {root}: {rel} is {kind}, not a regular file; Kiln reads only regular "
                                  f"files: remove it or put the file it stands for in its place")


def checkpoint_hash(path: Path, memo_path: Path | None = None) -> str:
    """Merkle hash of a checkpoint: sha256 over the sorted (relative path, file sha256) pairs of its files.

    Each file's sha256 is memoised per (real path, size, mtime_ns, inode), in this process and, when ``memo_path``
    is given, in that SQLite file (safe for concurrent processes), so an unchanged checkpoint is only stat'ed."""
    files = checkpoint_files(path)
    idents = {rel: _identity(files.root / rel) for rel in files.hashed}
    with _memo_lock:
        known = {ident: _memo[ident] for ident in idents.values() if ident in _memo}
    memo = _SqliteMemo(Path(memo_path)) if memo_path is not None else None
    if memo is not None and len(known) < len(idents):
        known.update(memo.get_many([ident for ident in idents.values() if ident not in known]))
    fresh = {ident: file_sha256(files.root / rel) for rel, ident in idents.items() if ident not in known}
    known.update(fresh)
    stable = {ident: known[ident] for rel, ident in idents.items() if _identity(files.root / rel) == ident}
    if memo is not None and fresh.keys() & stable.keys():
        memo.put({ident: stable[ident] for ident in fresh.keys() & stable.keys()})
    with _memo_lock:
        _memo.update(stable)
    merkle = hashlib.sha256()
    for rel, ident in idents.items():
        merkle.update(f"{rel}\0{known[ident]}\n".encode())
    return merkle.hexdigest()


def _identity(path: Path) -> tuple[str, int, int, int]:
    """What the memo is keyed by: the real path, size, mtime in ns and inode (a file changed while hashed differs)."""
    st = path.stat()
    return os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino


class _SqliteMemo:
    """Persistent file-hash memo: one row per real path, replaced when the file's identity changes."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        ensure_schema(path, _MEMO_SCHEMA)

    def get_many(self, idents: list[tuple[str, int, int, int]]) -> dict[tuple[str, int, int, int], str]:
        """The memoised hashes of those file identities that are still current."""
        found = {}
        with connect(self.path, _MEMO_SCHEMA) as db:
            for ident in idents:
                row = db.execute("SELECT sha256 FROM file_hash WHERE path=? AND size=? AND mtime_ns=? AND inode=?",
                                 ident).fetchone()
                if row:
                    found[ident] = row[0]
        return found

    def put(self, rows: dict[tuple[str, int, int, int], str]) -> None:
        with connect(self.path, _MEMO_SCHEMA) as db:
            db.executemany("INSERT OR REPLACE INTO file_hash VALUES (?, ?, ?, ?, ?)",
                           [(*ident, digest) for ident, digest in rows.items()])
