"""What the ``kiln cache`` commands report and do, as plain data (the CLI only prints it)."""

from __future__ import annotations

import shutil

from kiln.engines.cache.engine_cache import EngineCache
from kiln.engines.cache.errors import CacheUsageError
from kiln.engines.cache.eviction import EntryInfo, entry_info, evict, list_entries
from kiln.engines.cache.in_use import is_held
from kiln.engines.cache.keys import engine_key
from kiln.engines.cache.layout import dir_size
from kiln.engines.cache.remote.objects import RemoteUnavailableError
from kiln.engines.cache.remote.tier import RemoteTier
from kiln.engines.cache.results import described
from kiln.engines.cache.units import iso_utc
from kiln.engines.cache.verify import nearest_entry, verify_entry


def ls_entries(cache: EngineCache) -> list[dict]:
    """One row per entry, most recently used first: key, store, model, format, backend, gpu, size, times, hits."""
    hits = cache.stats.hits_by_key()
    rows = [_row(info, hits.get((info.store, info.key), 0)) for info in list_entries(cache.stores.values())]
    return rows[::-1]


def _row(info: EntryInfo, hits: int) -> dict:
    return {
        "key": info.key,
        "store": info.store,
        **described(info.describe),
        "size_bytes": info.size_bytes,
        "created": info.created,
        "last_used": iso_utc(info.last_used),
        "hits": hits,
    }


def show_entry(cache: EngineCache, key: str) -> dict:
    """Everything about one entry: key material, display fields, files with sizes and sha256, build record."""
    store, key = cache.find(key)
    manifest = store.read_manifest(key)
    info = entry_info(store, key)
    hits = cache.stats.hits_by_key().get((store.name, key), 0)
    return {
        "key": key,
        "store": store.name,
        "entry_dir": str(store.entry_dir(key)),
        "payload_dir": str(store.payload_dir(key)),
        "describe": manifest.get("describe", {}),
        "material": manifest.get("material"),
        "files": manifest.get("files", []),
        "size_bytes": manifest.get("total_bytes"),
        "created": manifest.get("created"),
        "last_used": iso_utc(info.last_used) if info else None,
        "hits": hits,
        "in_use": is_held(store.entry_dir(key)),
        "build_seconds": manifest.get("build_seconds"),
        "build": manifest.get("build"),
        "builder": manifest.get("builder"),
        "manifest_version": manifest.get("manifest_version"),
    }


def stats_report(cache: EngineCache, since: float | None = None) -> dict:
    """``kiln cache stats``: lookup figures of the engine store at the top level, build time saved, sizes and
    evictions of the whole cache (hits on quantized checkpoints save calibrations too), and every store's own
    figures under ``stores``."""
    entries = list_entries(cache.stores.values())
    stores = {}
    for name in cache.stores:
        summary = cache.stats.summary(name, since)
        own = [e for e in entries if e.store == name]
        summary.update(entries=len(own), size_bytes=sum(e.size_bytes for e in own))
        stores[name] = summary
    engines = stores["entries"]
    return {
        "root": str(cache.root),
        "since": iso_utc(since) if since is not None else None,
        "lookups": engines["lookups"],
        "hits": engines["hits"],
        "remote_hits": engines["remote_hits"],
        "misses": engines["misses"],
        "hit_rate": engines["hit_rate"],
        "misses_by_reason": engines["misses_by_reason"],
        "load_ms": engines["load_ms"],
        "build_seconds_saved": sum(s["build_seconds_saved"] for s in stores.values()),
        "size_bytes": sum(e.size_bytes for e in entries),
        "max_size_bytes": cache.max_size_bytes,
        "entries": len(entries),
        "max_entries": cache.max_entries,
        "evictions": sum(s["evictions"] for s in stores.values()),
        "remote": _recorded_remote(cache, stores),
        "stores": stores,
    }


def remote_report(cache: EngineCache) -> dict | None:
    """The remote tier's figures of this cache (``remote_totals``), None without a remote."""
    if cache.remote is None:
        return None
    return remote_totals(cache.remote.url, {name: cache.stats.summary(name) for name in cache.stores})


def _recorded_remote(cache: EngineCache, stores: dict[str, dict]) -> dict | None:
    """The remote tier's figures (``remote_totals``) when a remote is configured or its statistics recorded one (a
    later build or environment that configures none keeps them visible, with ``url`` null); else None."""
    url = cache.remote.url if cache.remote is not None else None
    totals = remote_totals(url, stores)
    return totals if url is not None or any(value for name, value in totals.items() if name != "url") else None


def remote_totals(url: str | None, stores: dict[str, dict]) -> dict:
    """The remote tier's figures summed over the stores (engines and quantized checkpoints travel alike)."""
    totals = {name: sum(store["remote"][name] for store in stores.values()) for name in stores["entries"]["remote"]}
    return {"url": url, **totals}


def verify_entries(cache: EngineCache, key: str | None = None, *, all_entries: bool = False) -> list[dict]:
    """Re-hash one entry or all of them; each result names its bad files (``problems``)."""
    if (key is None) == (not all_entries):
        raise CacheUsageError("kiln cache verify: give one KEY or --all")
    if key is not None:
        targets = [cache.find(key)]
    else:
        targets = [(store, k) for store in cache.stores.values() for k in store.list_keys()]
    results = []
    for store, k in targets:
        result = verify_entry(store, k)
        results.append({"key": k, "store": store.name, "ok": result.ok, "files_checked": result.files_checked,
                        "problems": result.problems, "incompatible": result.incompatible})
    return results


def prune(cache: EngineCache, *, max_size_bytes: int | None = None, older_than_s: float | None = None,
          dry_run: bool = False) -> dict:
    """Remove entries last used longer than ``older_than_s`` ago, then least recently used ones down to
    ``max_size_bytes`` (default: the configured limits, when neither bound is given); also sweep stale temporary
    builds and quarantined entries. Entries in use are kept and listed."""
    if max_size_bytes is None and older_than_s is None:
        max_size_bytes, max_entries = cache.max_size_bytes, cache.max_entries
    else:
        max_entries = None
    report = evict(cache.stores, max_size_bytes=max_size_bytes, max_entries=max_entries, older_than_s=older_than_s,
                   why="pruned", dry_run=dry_run)
    quarantined = sorted((cache.v1 / "quarantine").iterdir())
    quarantined_bytes = sum(dir_size(path) for path in quarantined)
    if not dry_run:
        for path in quarantined:
            shutil.rmtree(path, ignore_errors=True)
    swept = {path: size for store in cache.stores.values() for path, size in store.sweep(dry_run=dry_run).items()}
    return {
        "dry_run": dry_run,
        "removed": [{"key": e.key, "store": e.store, "size_bytes": e.size_bytes, "last_used": iso_utc(e.last_used)}
                    for e in report.removed],
        "in_use": [{"key": e.key, "store": e.store} for e in report.in_use],
        "freed_bytes": report.freed_bytes + quarantined_bytes + sum(swept.values()),
        "quarantined_removed": len(quarantined),
        "temporaries_swept": len(swept),
    }


def remove_entry(cache: EngineCache, key: str) -> dict:
    """``kiln cache rm KEY``: remove one entry unless a process holds it."""
    store, key = cache.find(key)
    freed = store.remove(key, "removed")
    return {"key": key, "store": store.name, "freed_bytes": freed}


def explain(cache: EngineCache, material: dict, store: str = "entries") -> dict:
    """Which fields of ``material`` differ from the nearest entry of ``store`` (none: it would be a hit), and
    whether the remote tier has the entry (``remote``: None without one)."""
    key, differences = nearest_entry(cache.stores[store], material)
    nearest = cache.stores[store].read_manifest(key) if key else None
    return {
        "nearest_key": key,
        "differences": [{"field": path, "entry": _at(nearest["material"], path), "config": _at(material, path)}
                        for path in differences] if nearest else [],
        "created": nearest.get("created") if nearest else None,
        "remote": remote_presence(cache.remote, store, engine_key(material)),
    }


def remote_presence(remote: RemoteTier | None, store: str, key: str) -> dict | None:
    """``{"url", "has_entry"}`` (``has_entry`` None and an ``error`` when the remote could not be asked), or None
    without a remote tier."""
    if remote is None:
        return None
    try:
        return {"url": remote.url, "has_entry": remote.has(store, key)}
    except RemoteUnavailableError as exc:
        return {"url": remote.url, "has_entry": None, "error": str(exc)}


ABSENT = "(absent)"


def _at(material: object, path: str) -> object:
    """The value at a dotted path from ``material_diff`` (``a.b[2].c``); ``ABSENT`` where the field is missing."""
    node = material
    for part in path.replace("[", ".[").split("."):
        if part.startswith("[") and isinstance(node, list):
            node = node[int(part[1:-1])]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return ABSENT
    return node
