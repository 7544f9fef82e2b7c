"""Checking what a store holds: a full re-hash of an entry against its manifest (``kiln cache verify``), and the
entry nearest to some key material (``kiln cache explain``'s miss reasons)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kiln.engines.cache.errors import CacheCorruptError
from kiln.engines.cache.hashing import file_sha256
from kiln.engines.cache.keys import material_diff
from kiln.engines.cache.layout import CORRUPT_MARK, MANIFEST, write_atomic
from kiln.engines.cache.manifest import MANIFEST_VERSION, file_problems, manifest_mismatch, stray_files
from kiln.engines.cache.store import ContentStore, utc_now


@dataclass(frozen=True)
class VerifyResult:
    """A full re-hash of one entry: ``problems`` names each bad file (empty when the entry is intact);
    ``incompatible`` says whose an entry of another Kiln or store is (not judged, so not corrupt either)."""

    store: str
    key: str
    entry_dir: Path
    files_checked: int
    problems: list[str]
    incompatible: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_entry(store: ContentStore, key: str) -> VerifyResult:
    """Re-hash every file of an entry against its manifest; a corrupt entry is marked so lookups rebuild it. An entry
    of another Kiln or store is reported as such and left as it is: its Kiln may serve it, so it is never marked."""
    entry = store.entry_dir(key)
    try:
        manifest = store.read_manifest(key)
    except CacheCorruptError as exc:
        store.stats.record_verify(store.name, key, False, str(exc))
        return VerifyResult(store.name, key, entry, 0, [str(exc)])
    if (whose := _foreign_entry(manifest, store.name, key)) is not None:
        return VerifyResult(store.name, key, entry, 0, [], f"{entry / MANIFEST}: {whose}")
    if (mismatch := manifest_mismatch(manifest, store.name, key)) is not None:  # what a lookup refuses
        problems, checked = [f"{entry / MANIFEST}: {mismatch[1]}"], 0
    else:
        problems = (file_problems(entry, store.payload_name, manifest, digest=file_sha256)
                    + stray_files(entry, store.payload_name, manifest))
        checked = len(manifest.get("files", []))
    if problems:
        write_atomic(entry / CORRUPT_MARK, json.dumps({"verified": utc_now(), "problems": problems}).encode())
    else:  # intact (a file put back, a false alarm): an earlier verify's mark must not force a rebuild
        (entry / CORRUPT_MARK).unlink(missing_ok=True)
    store.stats.record_verify(store.name, key, not problems, "; ".join(problems) or None)
    return VerifyResult(store.name, key, entry, checked, problems)


def _foreign_entry(manifest: dict, store: str, key: str) -> str | None:
    """Whose an entry is when its manifest is of another manifest version (a newer or older Kiln's) or another
    store's: not this Kiln's to judge. None when it is this store's."""
    version, owner = manifest.get("manifest_version"), manifest.get("store")
    if isinstance(version, int) and version != MANIFEST_VERSION:
        whose = f"{'a newer' if version > MANIFEST_VERSION else 'an older'} Kiln's entry{_built_by(manifest)}"
    elif version == MANIFEST_VERSION and isinstance(owner, str) and owner != store:
        whose = "another store's entry"
    else:
        return None
    return f"{manifest_mismatch(manifest, store, key)[1]}: {whose}, not this Kiln's to check; left as it is"


def _built_by(manifest: dict) -> str:
    """`` (built by Kiln X)`` when the manifest's key material records Kiln's version (an engine's does)."""
    material = manifest.get("material")
    toolchain = material.get("toolchain") if isinstance(material, dict) else None
    kiln = toolchain.get("kiln") if isinstance(toolchain, dict) else None
    return f" (built by Kiln {kiln})" if isinstance(kiln, str) else ""


def nearest_entry(store: ContentStore, material: dict) -> tuple[str | None, list[str]]:
    """The entry whose stored key material differs from ``material`` in the fewest fields, and those fields
    as dotted paths (``(None, [])`` when the store is empty). An exact match has no differing fields."""
    best: tuple[str | None, list[str]] = (None, [])
    for key in store.list_keys():
        try:
            stored = json.loads((store.entry_dir(key) / MANIFEST).read_bytes())["material"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        diff = material_diff(stored, material)
        if best[0] is None or len(diff) < len(best[1]):
            best = (key, diff)
    return best
