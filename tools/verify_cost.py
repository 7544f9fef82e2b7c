"""What checking a cached engine costs on a hit, per ``cache.verify_on_load`` mode, next to loading it.

    python tools/verify_cost.py [KEY_OR_PREFIX] [--load] [--repeats 5]

Times the hit check (``lookup`` without side effects) of one engine in ``$KILN_CACHE`` (default: the largest) under
``size``, ``changed`` and ``hash``, then with ``--load`` the engine's ``LLM.load``. Page cache as found: run it twice
for warm figures. Prints one JSON object; docs/cache.md reports the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kiln.engines.cache import EngineCache
from kiln.engines.cache.manifest import entry_size
from kiln.pipeline.config import cache_root
from kiln.runtime import LLM


def time_lookup(cache_dir, key: str, mode: str, repeats: int) -> dict:
    """Median and slowest of ``repeats`` hit checks in one mode (a fresh cache object each time, as a process has)."""
    times = []
    for _ in range(repeats):
        store = EngineCache(cache_dir, max_size_bytes=None, max_entries=None, verify_on_load=mode).entries
        start = time.perf_counter()
        found = store.lookup(key, record=False)
        times.append((time.perf_counter() - start) * 1000)
        if not found.hit:
            raise SystemExit(f"{key}: not a hit under verify_on_load={mode}: {found.detail}")
    return {"median_ms": round(statistics.median(times), 3), "max_ms": round(max(times), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("key", nargs="?", help="engine key or unique prefix (default: the largest engine)")
    parser.add_argument("--load", action="store_true", help="also time LLM.load of the engine")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cache_dir = cache_root()
    entries = EngineCache.open_configured(cache_dir).entries
    keys = [entries.complete_key(args.key)] if args.key else entries.list_keys()
    if not keys:
        raise SystemExit(f"{cache_dir}: no engine in the cache")
    key = max(keys, key=lambda k: entry_size(entries.entry_dir(k), entries.read_manifest(k)))
    report = {"key": key, "entry_bytes": entry_size(entries.entry_dir(key), entries.read_manifest(key)),
              "files": len(entries.read_manifest(key).get("files", {}))}
    for mode in ("size", "changed", "hash"):
        report[mode] = time_lookup(cache_dir, key, mode, 1 if mode == "hash" else args.repeats)
    if args.load:
        llm = LLM.load(entries.payload_dir(key))
        report["llm_load_ms"] = round(llm.load_ms, 1)
        report["changed_share_of_load"] = round(report["changed"]["median_ms"] / llm.load_ms, 6)
        llm.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
