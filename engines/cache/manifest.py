"""An entry's manifest: the payload's files with sizes and sha256, sealed last; checks of files against it.

manifest.json = {"manifest_version": 1, "store", "key", "material" (the key material), "describe" (display
fields), "payload" (folder name), "files": [{"path", "size", "sha256"}], "total_bytes", "created" (UTC ISO),
"build_seconds", "build" (the builder's record), "builder": {"host", "pid"}}. The last use is the mtime of the
entry's ``last_used`` file, so a hit never rewrites the manifest."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from kiln.engines.cache.hashing import file_sha256
from kiln.engines.cache.keys import engine_key
from kiln.engines.cache.layout import MANIFEST, dir_size, fsync_dir

MANIFEST_VERSION = 1


def seal_payload(payload: Path) -> list[dict]:
    """fsync every file and folder of a finished build and list its files; symlinks and special files are refused.

    Every file gets the mode a new file gets under the umask (0644 under 022), whatever its writer gave it:
    safetensors 0.8 writes through a temporary file of mode 0600, which other users of a shared cache cannot read."""
    regular, odd = payload_files(payload)
    if odd:
        raise ValueError(f"{odd[0]}: a cache payload holds regular files and folders only")
    mode = new_file_mode()
    files = []
    for path in regular:
        if path.stat().st_mode & 0o777 != mode:
            os.chmod(path, mode)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files.append({"path": path.relative_to(payload).as_posix(), "size": path.stat().st_size,
                      "sha256": file_sha256(path)})
    for dirpath, _, _ in os.walk(payload):
        fsync_dir(Path(dirpath))
    return files


def new_file_mode() -> int:
    """The permission bits ``open`` gives a new file under this process's umask."""
    umask = os.umask(0o022)  # reading the umask means setting it; restored at once
    os.umask(umask)
    return 0o666 & ~umask


def manifest_mismatch(manifest: object, store: str, key: str) -> tuple[str, str] | None:
    """Why a manifest is not that of entry ``key`` of ``store``: a lookup's miss reason (``incompatible``: another
    Kiln's or store's, or key material that does not hash to the key; ``corrupt``: another key's) and what is wrong.
    None when it is the entry's."""
    version = manifest.get("manifest_version") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or version != MANIFEST_VERSION:
        return "incompatible", f"manifest version {version!r}, this Kiln reads {MANIFEST_VERSION}"
    if manifest.get("store") != store:
        return "incompatible", f"manifest of store {manifest.get('store')!r}, not {store!r}"
    if manifest.get("key") != key:
        return "corrupt", f"manifest names key {manifest.get('key')!r}"
    stored = manifest.get("material")
    if not isinstance(stored, dict) or engine_key(stored) != key:
        return "incompatible", "stored key material does not hash to the key"
    return None


def file_problems(entry: Path, payload_name: str, manifest: dict, *, digest: Callable[[Path], str] | None,
                  first_only: bool = False) -> list[str]:
    """Listed files that are missing, of the wrong size or (given ``digest``, a file's sha256 hex) of the wrong
    sha256, each named by path, then a ``total_bytes`` that is not their sizes' sum.

    A path that is absolute or climbs out of the payload is a problem and is never touched, and so is one through a
    folder that is a link (the payload's files would be read from wherever it points)."""
    files = manifest.get("files")
    if not isinstance(files, list):
        return [f"{entry / MANIFEST}: no file list"]
    problems: list[str] = []
    for item in files:
        rel = item.get("path") if isinstance(item, dict) else None
        if not safe_relpath(rel):
            problems.append(f"{entry / MANIFEST}: unsafe file path {rel!r}")
        elif (link := _linked_folder(entry, f"{payload_name}/{rel}")) is not None:
            problem = f"{link}: a link, not a folder of the entry"
            if problem not in problems:  # once for all the files under it
                problems.append(problem)
        else:
            problems.extend(_problem_of(entry / payload_name / rel, item, digest))
        if problems and first_only:
            return problems
    if (wrong_total := total_problem(manifest)) is not None:
        problems.append(f"{entry / MANIFEST}: {wrong_total}")
    return problems


def total_problem(manifest: dict) -> str | None:
    """Why the manifest's ``total_bytes`` (what eviction, ``ls`` and the stats count) is not the sum of its files'
    sizes; None when it is."""
    sizes = [item.get("size") for item in manifest.get("files", []) if isinstance(item, dict)]
    total = manifest.get("total_bytes")
    if not all(isinstance(size, int) for size in sizes) or total == sum(sizes):
        return None  # a file record without a size is named where that file is checked
    return f"total_bytes {total!r} is not the sum of its files' sizes ({sum(sizes)})"


def stray_files(entry: Path, payload_name: str, manifest: dict, *, hidden: bool = True) -> list[str]:
    """Files in the payload that the manifest does not list, and anything that is not a regular file; ``hidden``
    False leaves out dotfiles (an editor's swap file, .DS_Store), which no loader reads."""
    payload = entry / payload_name
    listed = {item.get("path") for item in manifest.get("files", []) if isinstance(item, dict)}
    regular, odd = payload_files(payload)

    def shown(path: Path) -> bool:
        return hidden or not path.name.startswith(".")

    return ([f"{path}: not in the manifest" for path in regular
             if shown(path) and path.relative_to(payload).as_posix() not in listed]
            + [f"{path}: not a regular file" for path in odd if shown(path)])


def payload_files(root: Path) -> tuple[list[Path], list[Path]]:
    """The regular files under ``root`` (sorted) and anything else there (symlinks, devices, sockets)."""
    regular, odd = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                odd.append(path)
            elif path.is_file():
                regular.append(path)
    return sorted(regular), sorted(odd)


def read_manifest(entry: Path) -> dict | None:
    """The entry's parsed manifest; None when it is missing, unreadable or not a JSON object."""
    try:
        manifest = json.loads((entry / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def entry_size(entry: Path, manifest: dict | None = None) -> int:
    """Bytes of an entry's payload as its manifest records them (measured on disk when it cannot be read); pass the
    manifest when it is already parsed."""
    manifest = read_manifest(entry) if manifest is None else manifest
    try:
        return int(manifest["total_bytes"])
    except (KeyError, TypeError, ValueError):
        return dir_size(entry)


def _linked_folder(entry: Path, rel: str) -> Path | None:
    """The first folder on the way from ``entry`` to its file ``rel`` that is a symbolic link; None when none is."""
    folder = entry
    for part in rel.split("/")[:-1]:
        folder = folder / part
        if folder.is_symlink():
            return folder
    return None


def _problem_of(path: Path, item: dict, digest: Callable[[Path], str] | None) -> list[str]:
    """What is wrong with one listed file, as ``["<path>: <problem>"]`` (empty when nothing is); a path that cannot
    be read (a link loop or a file where a folder was, no permission) is a problem, never an error."""
    try:
        problem = _mismatch(path, item, digest)
    except FileNotFoundError:
        problem = "missing"
    except OSError as exc:
        problem = f"unreadable ({exc.strerror or exc})"
    return [f"{path}: {problem}"] if problem else []


def _mismatch(path: Path, item: dict, digest: Callable[[Path], str] | None) -> str | None:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size != item.get("size"):
        return f"{st.st_size} bytes, manifest says {item.get('size')}"
    if digest is not None and digest(path) != item.get("sha256"):
        return "sha256 differs from the manifest (content changed)"
    return None


def safe_relpath(rel: object) -> bool:
    """Whether ``rel`` is a relative ``/``-separated path that stays inside the folder it is joined to."""
    if not isinstance(rel, str) or not rel or "\\" in rel:
        return False
    path = PurePosixPath(rel)
    return not path.is_absolute() and all(part not in ("..", ".", "") for part in rel.split("/"))
