"""What ``kiln cache push|pull`` and ``ls|verify|prune --remote`` do and print (the commands are in
``cache_commands.py``): tables and summary lines for a person, ``--json`` objects for a machine."""

from __future__ import annotations

from collections.abc import Callable

from kiln.engines.cache import CacheCorruptError, CacheResult, CacheUsageError, EngineCache
from kiln.engines.cache.keys import check_key_prefix, match_prefix
from kiln.engines.cache.remote.layout import REMOTE_STORES
from kiln.engines.cache.remote.maintenance import (
    RemoteEntry,
    prune_remote,
    remote_entries,
    stored_blobs,
    verify_remote,
)
from kiln.engines.cache.remote.tier import RemoteTier
from kiln.engines.cache.results import LS_ROW_KEYS, uniform_rows
from kiln.engines.cache.units import format_bytes, format_seconds
from kiln.pipeline.cache_tables import STORE_LABEL, ago, entries_table, entries_text, rate
from kiln.pipeline.console import print_json, stderr, stdout, transfer_bars
from kiln.runtime.errors import KilnError


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else format_seconds(seconds)


def push(cache: EngineCache, key: str | None, *, all_entries: bool, force: bool, json_out: bool) -> None:
    """Upload one local entry (engine or quantized checkpoint) or all of them. With ``--json``, an entry that fails
    ends the object with ``error``, after the rows of those pushed before it."""
    tier = cache.entries.require_remote()
    if (key is None) == (not all_entries):
        raise CacheUsageError("kiln cache push: give one KEY or --all")
    if key is not None:
        store, key = cache.find(key)
        if store.name not in REMOTE_STORES:
            raise CacheUsageError(f"cache key {key}: a generated bench checkpoint; those stay in the local cache")
        targets = [(store, key)]
    else:
        targets = [(cache.stores[name], k) for name in REMOTE_STORES for k in cache.stores[name].list_keys()]
    rows = []
    with transfer_bars() as bars:
        for store, k in targets:
            try:
                result = store.push(k, replace=force, on_transfer=bars(k[:12]))
            except KilnError as exc:
                if json_out:  # printed: the error line follows on stderr, without another JSON object
                    print_json({"remote": tier.url, "pushed": rows,
                                "error": {"type": type(exc).__name__, "message": str(exc)}})
                raise
            rows.append({"key": k, "store": store.name, "outcome": result.outcome, "bytes": result.bytes,
                         "seconds": result.seconds, "files_uploaded": result.files_uploaded})
            if not json_out:
                what = STORE_LABEL[store.name]
                if result.outcome == "present":
                    stdout.print(f"{k} ({what}) is already on {tier.url}", highlight=False, soft_wrap=True)
                else:
                    stdout.print(f"pushed {k} ({what}, {format_bytes(result.bytes)} in "
                                 f"{_seconds(result.seconds)}, {rate(result.bytes, result.seconds)})",
                                 highlight=False, soft_wrap=True)
    if json_out:
        print_json({"remote": tier.url, "pushed": rows})
    else:
        present = sum(row["outcome"] == "present" for row in rows)
        already = f"; {present} {'was' if present == 1 else 'were'} already there" if present else ""
        stderr.print(f"pushed {entries_text(len(rows) - present)} to {tier.url}{already}", highlight=False)


def pull(open_cache: Callable[[], EngineCache], tier: RemoteTier, key: str, *, json_out: bool) -> None:
    """Install one remote entry (a key or a unique prefix of one) of ``tier`` in the local cache ``open_cache``
    opens (only once the entry is found: a failed pull creates no cache), every file checked."""
    entry = _complete_remote_key(tier, key)
    cache = open_cache()
    store = cache.stores[entry.store]
    with transfer_bars() as bars:
        result = store.pull(entry.key, on_transfer=bars(entry.key[:12]))
    stats = cache.stats.summary(store.name)["remote"]
    report = {"key": entry.key, "store": store.name, "pulled": result.pulled, "path": str(result.payload_dir),
              "remote": tier.url}
    if json_out:
        print_json(report)
    elif result.pulled:
        stdout.print(f"pulled {entry.key} ({STORE_LABEL[store.name]}) into {result.payload_dir}", highlight=False,
                     soft_wrap=True)
        stderr.print(f"{format_bytes(entry.size_bytes)}, every file's sha256 checked; this cache has pulled "
                     f"{format_bytes(stats['pulled_bytes'])} in {_seconds(stats['pull_seconds'])}",
                     highlight=False)
    else:
        stdout.print(f"{entry.key} is already in the local cache: {result.payload_dir}", highlight=False,
                     soft_wrap=True)


def pull_engine(cache: EngineCache, prefix: str) -> CacheResult:
    """Pull the remote engine whose key starts with ``prefix`` into the local cache (checked file by file, with a
    progress bar), held from before it is published; what the serve and bench targets do with a key this machine
    lacks."""
    tier = cache.entries.require_remote()
    entry = _complete_remote_key(tier, prefix)
    if entry.store != "entries":
        raise CacheUsageError(f"cache key {entry.key} on {tier.url} is a quantized checkpoint, not an engine; give "
                              f"an engine's key (`kiln cache ls --remote`)")
    stderr.print(f"engine {entry.key[:12]} is not in the local cache: pulling it from {tier.url}", highlight=False)
    with transfer_bars() as bars:
        return cache.entries.pull(entry.key, on_transfer=bars(entry.key[:12]), hold=True)


def _remote_entry(tier: RemoteTier, prefix: str) -> RemoteEntry:
    """The remote entry of a key, or of the one key that starts with ``prefix``, damaged or not."""
    check_key_prefix(prefix, "kiln cache ls --remote")
    entries = {entry.key: entry for entry in remote_entries(tier)}
    return entries[match_prefix(prefix, set(entries), "", f"on {tier.url}", "see `kiln cache ls --remote`")]


def _complete_remote_key(tier: RemoteTier, prefix: str) -> RemoteEntry:
    entry = _remote_entry(tier, prefix)
    if entry.manifest is None:
        fix = "upgrade Kiln to pull it" if entry.newer else "`kiln cache prune --remote` removes it"
        raise CacheCorruptError(f"cache key {entry.key} on {tier.url}: {entry.problem}; it is never pulled ({fix})")
    return entry


def ls(tier: RemoteTier, *, json_out: bool) -> None:
    """One row per remote entry, most recently used first, with the keys of a local row."""
    rows = uniform_rows([entry.row() for entry in remote_entries(tier)], LS_ROW_KEYS)
    if json_out:
        print_json(rows)
        return
    if rows:
        stdout.print(entries_table(rows), highlight=False)
    stored = sum(info.size for info in stored_blobs(tier).values())  # a file several entries list is stored once
    stderr.print(f"{entries_text(len(rows))}, {format_bytes(sum(r['size_bytes'] for r in rows))} listed, "
                 f"{format_bytes(stored)} stored on {tier.url}", highlight=False)


def verify_results(tier: RemoteTier, key: str | None, *, all_entries: bool) -> tuple[list[dict], str]:
    """Read back one remote entry (a key or a prefix of one) or all of them, checking every file: the results (as
    ``kiln cache verify`` reports them) and the remote's URL."""
    if (key is None) == (not all_entries):
        raise CacheUsageError("kiln cache verify --remote: give one KEY or --all")
    return verify_remote(tier, None if key is None else [_remote_entry(tier, key)]), tier.url


def prune(tier: RemoteTier, *, max_size_bytes: int | None, older_than_s: float | None, dry_run: bool,
          grace_s: float, json_out: bool) -> None:
    """Remove old or least recently used remote entries, then the files no entry lists."""
    if max_size_bytes is None and older_than_s is None:
        raise CacheUsageError("kiln cache prune --remote: give --older-than and/or --max-size (the remote has no "
                              "configured limits)")
    report = prune_remote(tier, older_than_s=older_than_s, max_size_bytes=max_size_bytes, dry_run=dry_run,
                          grace_s=grace_s)
    if json_out:
        print_json(report)
        return
    verb = "would remove" if dry_run else "removed"
    for entry in report["removed"]:
        why = f"damaged: {entry['problem']}" if entry["problem"] else f"last used {ago(entry['last_used'])}"
        stdout.print(f"{verb} {entry['key']} ({STORE_LABEL[entry['store']]}, {format_bytes(entry['size_bytes'])}, "
                     f"{why})", highlight=False, soft_wrap=True)
    stderr.print(f"{'would free' if dry_run else 'freed'} {format_bytes(report['freed_bytes'])} in "
                 f"{report['files_removed']} files on {tier.url}; {entries_text(report['kept'])} kept, "
                 f"{format_bytes(report['stored_bytes'])} stored", highlight=False)
    if report["newer_entries"]:
        stderr.print(f"{report['newer_entries']} entries of a newer Kiln are on {tier.url}: no file was deleted "
                     f"(a newer Kiln's `kiln cache prune --remote` can tell which files they list)", highlight=False)
    if report["unfinished_writes_removed"]:
        stderr.print(f"{'would discard' if dry_run else 'discarded'} {report['unfinished_writes_removed']} "
                     f"unfinished uploads (a push killed half way)", highlight=False)
