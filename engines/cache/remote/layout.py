"""Where things live under a remote's prefix. Files are stored once by content, entries are their manifests:

    v1/<store>/<key[:2]>/<key>/manifest.json   an entry: the local manifest, uploaded after every file it lists
    v1/<store>/<key[:2]>/<key>/last_used       rewritten by each pull (as it starts and once done) and push
    v1/blobs/<sha256[:2]>/<sha256>             a payload file, named by its content
    v1/reused/<sha256[:2]>/<sha256>            rewritten by each push that lists that file without uploading it
    v1/leases/<store>-<key>.json               a machine building the entry now (refreshed while it builds)

A reader looks for the manifest only, so an entry whose push stopped half-way (blobs, no manifest) does not exist
for it; two machines pushing one key upload their own files under their own digests and each manifest names only
files that are there. The last use and the reuse marks tell ``prune --remote`` what a pull or push in flight needs."""

from __future__ import annotations

from kiln.engines.cache.keys import validate_key

VERSION = "v1"
REMOTE_STORES = ("entries", "quantized")  # generated bench checkpoints stay local: random weights are cheap to remake
MANIFEST = "manifest.json"
LAST_USED = "last_used"


def entry_prefix(store: str, key: str) -> str:
    return f"{VERSION}/{store}/{validate_key(key)[:2]}/{key}/"


def manifest_name(store: str, key: str) -> str:
    return entry_prefix(store, key) + MANIFEST


def last_used_name(store: str, key: str) -> str:
    return entry_prefix(store, key) + LAST_USED


def blob_name(sha256: str) -> str:
    return f"{VERSION}/blobs/{sha256[:2]}/{sha256}"


def reused_name(sha256: str) -> str:
    return f"{VERSION}/reused/{sha256[:2]}/{sha256}"


def lease_name(store: str, key: str) -> str:
    return f"{VERSION}/leases/{store}-{validate_key(key)}.json"


def parse_entry_name(name: str) -> tuple[str, str, str] | None:
    """(store, key, file) of an object inside an entry's folder; None for any other object."""
    parts = name.split("/")
    if len(parts) != 5 or parts[0] != VERSION or parts[1] not in REMOTE_STORES or parts[4] not in (MANIFEST, LAST_USED):
        return None
    return parts[1], parts[3], parts[4]
