"""Content hashes: sha256 of a file, memoised per file identity (real path, size, mtime, ctime, inode), and the Merkle
hash of a checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.engines.cache.db import connect, ensure_schema, expendable
from kiln.engines.cache.errors import CheckpointHashError
from kiln.engines.cache.layout import read_only_db
from kiln.runtime.tokenizer_files import CHAT_TEMPLATES_DIR

WEIGHT_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONFIG_SUFFIXES = (".json",)  # config, generation config, quantization config, index, tokenizer JSON files
TOKENIZER_SUFFIXES = (".tiktoken", ".jinja")  # .jinja: chat templates, which the build copies into the engine
TOKENIZER_NAMES = frozenset({"tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "merges.txt", "vocab.txt"})
INDEX_FILE = "model.safetensors.index.json"
# the fix for a dangling link of a model folder (``dangling_link``)
COPIED_SNAPSHOT_FIX = "copy the snapshot with `cp -rL` (following links) or point model.path at the hub cache"

# ctime cannot be set back by a user (mtime can, with touch -r): a file written in place always gets a new identity.
# Paths are their bytes (a folder's name need not be UTF-8); the table of text paths before them is left unused.
_MEMO_SCHEMA = ("CREATE TABLE IF NOT EXISTS file_sha256_by_path_bytes (path BLOB PRIMARY KEY, size INTEGER, "
                "mtime_ns INTEGER, ctime_ns INTEGER, inode INTEGER, sha256 TEXT)",)

Identity = tuple[bytes, int, int, int, int]
_memo: dict[Identity, str] = {}
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
    """Weight (*.safetensors), config (*.json), tokenizer and chat template (*.jinja) files at the top of ``path``,
    and the named chat templates of its ``additional_chat_templates/``, hidden files skipped: every file a build
    reads or copies into what it builds. Other subfolders are never read (a hub repo's ``original/params.json``,
    say), so they are not hashed and adding one keeps the key.

    Pickle weights (*.bin, *.pt, ...) are only listed: a checkpoint whose weights are all pickles is refused. Links
    are followed, and a file that is not a regular file once its links are resolved (a device such as /dev/zero, a
    FIFO, a dangling or looping link) is refused by name."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointHashError(f"checkpoint {root}: not a directory (or a link that does not resolve to one); "
                                  f"point model.path at the checkpoint folder")
    hashed, pickles = [], []
    shards = index_shards(root)
    for name in sorted(os.listdir(root)):
        if name.startswith(".") or (root / name).is_dir():
            continue
        if shards is not None and name.endswith(WEIGHT_SUFFIXES) and name not in shards:
            continue  # beside an index, a file it does not name is never read (a Mistral repo's consolidated one)
        if name.endswith(PICKLE_SUFFIXES):
            pickles.append(name)
        elif name.endswith(WEIGHT_SUFFIXES + CONFIG_SUFFIXES + TOKENIZER_SUFFIXES) or name in TOKENIZER_NAMES:
            _require_regular_file(root, name)
            hashed.append(name)
    templates = root / CHAT_TEMPLATES_DIR  # transformers 5's named chat templates, which the build copies too
    for path in sorted(templates.glob("*.jinja")) if templates.is_dir() else ():
        _require_regular_file(root, f"{CHAT_TEMPLATES_DIR}/{path.name}")
        hashed.append(f"{CHAT_TEMPLATES_DIR}/{path.name}")
    if not any(name.endswith(WEIGHT_SUFFIXES) for name in hashed):
        if pickles:
            raise CheckpointHashError(
                f"checkpoint {root}: only pickle weights ({', '.join(pickles)}); Kiln never unpickles, "
                "convert the checkpoint to safetensors")
        raise CheckpointHashError(f"checkpoint {root}: no *.safetensors weight files found")
    return CheckpointFiles(root=root, hashed=hashed, pickles=pickles)


def index_shards(folder: Path) -> set[str] | None:
    """The shard files that ``folder``'s model.safetensors.index.json names in its weight_map; None without an index
    or with one that has no weight_map object."""
    try:
        weight_map = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return None
    return {str(shard) for shard in weight_map.values()} if isinstance(weight_map, dict) else None


def dangling_link(path: Path) -> str | None:
    """"NAME is a link to TARGET that does not exist" where ``path`` is a link that resolves to no file (a Hugging
    Face snapshot copied with ``cp -r``, whose links into ../../blobs then dangle); None otherwise."""
    if path.is_symlink() and not path.exists():
        return f"{path.name} is a link to {os.readlink(path)} that does not exist"
    return None


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
    """Merkle hash of a checkpoint: ``merkle_hash`` of its ``checkpoint_digests``."""
    return merkle_hash(checkpoint_digests(path, memo_path))


def checkpoint_digests(path: Path, memo_path: Path | None = None) -> dict[str, str]:
    """The sha256 of each file ``checkpoint_files`` covers, by its path relative to ``path``, through
    ``FileHashes(memo_path)`` (an unchanged checkpoint is only stat'ed)."""
    files = checkpoint_files(path)
    digests = FileHashes(memo_path).sha256_many([files.root / rel for rel in files.hashed])
    return dict(zip(files.hashed, digests, strict=True))


def merkle_hash(digests: Mapping[str, str]) -> str:
    """sha256 over the (relative path, file sha256) pairs of ``digests``, in their order (``checkpoint_files``')."""
    merkle = hashlib.sha256()
    for rel, digest in digests.items():
        merkle.update(f"{rel}\0{digest}\n".encode())
    return merkle.hexdigest()


class FileHashes:
    """sha256 of files, memoised per identity (real path, size, mtime, ctime, inode) in this process and, when
    ``memo_path`` is given, in that SQLite file (safe for concurrent processes; only read where this user cannot
    write it): a file is read again only once it has changed, been replaced or moved."""

    def __init__(self, memo_path: Path | None = None) -> None:
        self._db = _SqliteMemo(Path(memo_path)) if memo_path is not None else None

    def sha256_many(self, paths: Sequence[Path]) -> list[str]:
        """Each file's sha256 hex, read only where its identity is not memoised; a file that changed while it was
        read is not memoised."""
        idents = [_identity(path) for path in paths]
        with _memo_lock:
            known = {ident: _memo[ident] for ident in idents if ident in _memo}
        if self._db is not None and len(known) < len(idents):
            known.update(self._db.get_many([ident for ident in idents if ident not in known]))
        fresh = {ident: file_sha256(path) for path, ident in zip(paths, idents, strict=True) if ident not in known}
        known.update(fresh)
        stable = {ident: fresh[ident] for path, ident in zip(paths, idents, strict=True)
                  if ident in fresh and _identity(path) == ident}
        self._remember(stable)
        return [known[ident] for ident in idents]

    def sha256(self, path: Path) -> str:
        """One file's sha256 hex (``sha256_many``)."""
        return self.sha256_many([path])[0]

    def remember(self, digests: dict[Path, str]) -> None:
        """Memoise sha256 digests already known for these files as they are now (a build's files just sealed)."""
        self._remember({_identity(path): digest for path, digest in digests.items()})

    def _remember(self, rows: dict[Identity, str]) -> None:
        if not rows:
            return
        if self._db is not None:
            self._db.put(rows)
        with _memo_lock:
            _memo.update(rows)


def _identity(path: Path) -> Identity:
    """What the memo is keyed by: the real path (its bytes), size, mtime and ctime in ns, and inode."""
    st = path.stat()
    return os.fsencode(os.path.realpath(path)), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


class _SqliteMemo:
    """Persistent file-hash memo: one row per real path, replaced when the file's identity changes; files are hashed
    again, with one warning, while it cannot be used (a full disk). One this user cannot write (in a read-only
    cache) is only read."""

    @expendable(lambda: None)
    def __init__(self, path: Path) -> None:
        self.path = path
        self.read_only = path.exists() and not os.access(path, os.W_OK)
        if not self.read_only:
            path.parent.mkdir(parents=True, exist_ok=True)
            ensure_schema(path, _MEMO_SCHEMA)

    @expendable(dict)
    def get_many(self, idents: list[Identity]) -> dict[Identity, str]:
        """The memoised hashes of those file identities that are still current."""
        found = {}
        with read_only_db(self.path) if self.read_only else connect(self.path, _MEMO_SCHEMA) as db:
            for ident in idents:
                row = db.execute("SELECT sha256 FROM file_sha256_by_path_bytes WHERE path=? AND size=? AND "
                                 "mtime_ns=? AND ctime_ns=? AND inode=?", ident).fetchone()
                if row:
                    found[ident] = row[0]
        return found

    @expendable(lambda: None)
    def put(self, rows: dict[Identity, str]) -> None:
        if self.read_only:
            return
        with connect(self.path, _MEMO_SCHEMA) as db:
            db.executemany("INSERT OR REPLACE INTO file_sha256_by_path_bytes VALUES (?, ?, ?, ?, ?, ?)",
                           [(*ident, digest) for ident, digest in rows.items()])
