"""``kiln cache``: ls, show, stats, verify, prune, rm, and push / pull / ``--remote`` for the remote tier. Tables
for a person on stdout, ``--json`` for a machine; notes on stderr."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from kiln.engines.cache import CacheCorruptError, CacheUsageError, EngineCache
from kiln.engines.cache import inspect as cache_inspect
from kiln.engines.cache.engine_cache import read_remote
from kiln.engines.cache.remote.maintenance import PRUNE_GRACE_S
from kiln.engines.cache.remote.spec import RemoteSpec
from kiln.engines.cache.remote.tier import RemoteTier
from kiln.engines.cache.results import LS_ROW_KEYS, VERIFY_ROW_KEYS, uniform_rows
from kiln.engines.cache.units import (
    format_ago,
    format_bytes,
    format_seconds,
    parse_duration,
    parse_iso,
    parse_since,
    parse_size,
)
from kiln.pipeline import cache_remote
from kiln.pipeline.cache_tables import STORE_LABEL, ago, entries_table, entries_text, rate
from kiln.pipeline.config import cache_root, load_config, remote_spec, remote_turned_off
from kiln.pipeline.console import friendly_errors, print_json, stderr, stdout, warn

cache_app = typer.Typer(help="Inspect and maintain the engine cache, and share it through a remote.",
                        no_args_is_help=True, rich_markup_mode=None)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable object on stdout.")]
KeyArg = Annotated[str, typer.Argument(help="A cache key (64 hex characters, as `kiln cache ls` prints it) or a "
                                              "unique prefix of at least 4.")]
CacheDirOpt = Annotated[Path | None, typer.Option(
    "--cache-dir", help="The cache root (default: $KILN_CACHE, else the --config's cache.dir, else ~/.cache/kiln).")]
ConfigOpt = Annotated[str | None, typer.Option("--config", help="Take the cache root (and remote) from this config "
                                                                  "file.")]
RemoteOpt = Annotated[bool, typer.Option("--remote", help="Act on the remote cache ($KILN_CACHE_REMOTE, else the "
                                                          "config's cache.remote, else the one the last build used).")]


def _where(cache_dir: Path | None, config: str | None) -> tuple[Path, RemoteSpec | None]:
    """The cache root named by --cache-dir, else by the config (``$KILN_CACHE`` overrides its cache.dir), else the
    default; and the remote named by ``$KILN_CACHE_REMOTE``, else by the config (None when neither names one)."""
    section = load_config(config).config.cache if config is not None else None
    root = section.root() if section is not None else cache_root()
    root = cache_dir.expanduser().resolve() if cache_dir is not None else root  # absolute, as $KILN_CACHE's
    return root, section.remote_spec() if section is not None else remote_spec()


def _open(cache_dir: Path | None, config: str | None, *, create: bool = False) -> EngineCache:
    """The local cache (see ``_where``); its remote tier is the one named, else the one its last build recorded.
    Without ``create`` (commands that read or remove), a root with no cache is an error that creates nothing there:
    a mistyped path is not reported as an empty, healthy cache."""
    root, remote = _where(cache_dir, config)
    return EngineCache.open_configured(root, remote=remote, recorded_remote=not remote_turned_off(), warn=warn,
                                       create=create)


def _remote_tier(cache_dir: Path | None, config: str | None) -> RemoteTier:
    """The remote tier for ``--remote`` listings and maintenance: the one named (see ``_where``), else the one the
    local cache's last build recorded. Nothing local is created."""
    root, remote = _where(cache_dir, config)
    remote = remote or (None if remote_turned_off() else read_remote(root))
    if remote is None:
        raise CacheUsageError(f"no remote cache is configured (none in $KILN_CACHE_REMOTE or the config, and no "
                              f"build under {root} recorded one, or $KILN_CACHE_REMOTE is set empty): set "
                              f"cache.remote in the config, or "
                              f"$KILN_CACHE_REMOTE (s3://bucket/prefix or file:///shared/folder)")
    return RemoteTier(remote, warn=warn)


@cache_app.command("ls")
@friendly_errors
def ls(remote: RemoteOpt = False, cache_dir: CacheDirOpt = None, config: ConfigOpt = None,
       json_out: JsonOpt = False) -> None:
    """One row per entry, most recently used first: key, model, format, backend, GPU, size, created, last used, hits."""
    if remote:
        cache_remote.ls(_remote_tier(cache_dir, config), json_out=json_out)
        return
    cache = _open(cache_dir, config)
    rows = uniform_rows(cache_inspect.ls_entries(cache), LS_ROW_KEYS)
    if json_out:
        print_json(rows)
        return
    if rows:
        stdout.print(entries_table(rows), highlight=False)
    total = sum(row["size_bytes"] for row in rows)
    stderr.print(f"{entries_text(len(rows))}, {format_bytes(total)} in {cache.root}", highlight=False)


@cache_app.command("show")
@friendly_errors
def show(key: KeyArg, cache_dir: CacheDirOpt = None, config: ConfigOpt = None, json_out: JsonOpt = False) -> None:
    """Key material, files and build record of one entry."""
    entry = cache_inspect.show_entry(_open(cache_dir, config), key)
    if json_out:
        print_json(entry)
        return
    describe = entry["describe"]
    facts = Table(box=None, show_header=False, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column()
    for label, value in (
        ("key", entry["key"]), ("kind", STORE_LABEL.get(entry["store"], entry["store"])),
        ("path", entry["payload_dir"]),
        *((name, str(describe[name])) for name in ("model", "format", "backend", "gpu") if describe.get(name)),
        ("size", format_bytes(entry["size_bytes"])), ("created", f"{entry['created']} ({ago(entry['created'])})"),
        ("last used", f"{entry['last_used']} ({ago(entry['last_used'])})"), ("hits", str(entry["hits"])),
        ("in use", "yes" if entry["in_use"] else "no"),
        ("build time", format_seconds(entry["build_seconds"] or 0)),
    ):
        facts.add_row(label, value)
    stdout.print(facts, highlight=False)
    stdout.print("\n[bold]key material[/]", markup=True)
    stdout.print_json(json.dumps(entry["material"]))
    files = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("FILE", "SIZE", "SHA256"):
        files.add_column(column, justify="right" if column == "SIZE" else "left")
    for item in entry["files"]:
        files.add_row(item["path"], format_bytes(item["size"]), item["sha256"])
    stdout.print("\n[bold]files[/]", markup=True)
    stdout.print(files, highlight=False)
    stdout.print("\n[bold]build record[/]", markup=True)
    stdout.print_json(json.dumps(entry["build"]))


@cache_app.command("stats")
@friendly_errors
def stats(
    since: Annotated[str | None, typer.Option(help="Only events since this long ago (7d, 12h) or this date.")] = None,
    zero: Annotated[bool, typer.Option("--zero", help="Reset the statistics (entries are kept).")] = False,
    cache_dir: CacheDirOpt = None, config: ConfigOpt = None, json_out: JsonOpt = False,
) -> None:
    """Hit rate, misses by reason, load latency, build time saved, size and evictions (like ccache -s)."""
    cache = _open(cache_dir, config)
    if zero:
        cache.stats.zero()
        stderr.print(f"statistics of {cache.root} zeroed")
    report = cache_inspect.stats_report(cache, parse_since(since) if since else None)
    if json_out:
        print_json(report)
        return
    table = Table(box=None, show_header=False, pad_edge=False, title=f"engine cache {report['root']}",
                  title_justify="left", title_style="bold")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    hit_rate = report["hit_rate"]
    reasons = ", ".join(f"{n} {reason}" for reason, n in report["misses_by_reason"].items() if n)
    load = report["load_ms"]
    table.add_row("lookups", str(report["lookups"]), f"since {report['since']}" if report["since"] else "")
    pulled_hits = f" ({report['remote_hits']} pulled from the remote)" if report["remote_hits"] else ""
    table.add_row("hits", str(report["hits"]), f"{hit_rate:.1%} hit rate{pulled_hits}" if hit_rate is not None else "")
    table.add_row("misses", str(report["misses"]), reasons)
    table.add_row("load latency p50", _ms(load["p50"]), f"p95 {_ms(load['p95'])}, p99 {_ms(load['p99'])}, "
                  f"max {_ms(load['max'])}, {load['count']} loads")
    saved_by_store = ", ".join(f"{name} {format_seconds(store['build_seconds_saved'])}"
                               for name, store in report["stores"].items() if store["build_seconds_saved"])
    table.add_row("build time saved", format_seconds(report["build_seconds_saved"]), saved_by_store)
    table.add_row("size", format_bytes(report["size_bytes"]), f"of {format_bytes(report['max_size_bytes'])}")
    table.add_row("entries", str(report["entries"]),
                  f"of {report['max_entries']}" if report["max_entries"] is not None else "unbounded")
    table.add_row("evictions", str(report["evictions"]), "")
    if (remote := report["remote"]) is not None:
        pulls = remote["hits"] + remote["misses"] + remote["corrupt"]
        where = remote["url"] or "the remote tier (none configured now)"
        table.add_row("remote pulls", f"{remote['hits']}/{pulls}", f"{where}: every pull, `kiln cache pull` and "
                      f"checkpoints included; {remote['corrupt']} refused as damaged, {remote['errors']} failed")
        pulled = remote["pulled_bytes"]
        table.add_row("pulled", format_bytes(pulled),
                      f"in {format_seconds(remote['pull_seconds'])}, {rate(pulled, remote['pull_seconds'])}")
        table.add_row("pushed", format_bytes(remote["pushed_bytes"]),
                      f"{remote['pushes']} entries in {format_seconds(remote['push_seconds'])}, "
                      f"{rate(remote['pushed_bytes'], remote['push_seconds'])}")
    for name in ("quantized", "checkpoints"):  # the checkpoint stores, when used
        store = report["stores"][name]
        if store["lookups"] or store["entries"]:
            store_rate = f", {store['hit_rate']:.1%}" if store["hit_rate"] is not None else ""
            table.add_row(STORE_LABEL[name], f"{store['hits']}/{store['lookups']} hits{store_rate}",
                          f"{store['entries']} checkpoints, {format_bytes(store['size_bytes'])}")
    stdout.print(table, highlight=False)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


@cache_app.command("verify")
@friendly_errors
def verify(
    key: Annotated[str | None, typer.Argument(help="The entry to re-hash (or --all).")] = None,
    all_entries: Annotated[bool, typer.Option("--all", help="Re-hash every entry.")] = False,
    remote: RemoteOpt = False, cache_dir: CacheDirOpt = None, config: ConfigOpt = None, json_out: JsonOpt = False,
) -> None:
    """Re-hash entries against their manifests; exit 3 naming each corrupt file (the entry is then rebuilt). With
    --remote, read the remote's files back (no local copy is made)."""
    if remote:
        results, where = cache_remote.verify_results(_remote_tier(cache_dir, config), key, all_entries=all_entries)
        fix = "Pulls refuse them; the next build of each pushes a good copy (or `kiln cache push --force KEY`)"
    else:
        cache = _open(cache_dir, config)
        results, where = cache_inspect.verify_entries(cache, key, all_entries=all_entries), str(cache.root)
        fix = "They are marked corrupt: the next build rebuilds them (or remove them with `kiln cache rm KEY`)"
    results = uniform_rows(results, VERIFY_ROW_KEYS)
    if json_out:
        print_json(results)
    else:
        table = Table(box=None, header_style="bold", pad_edge=False)
        for column in ("KEY", "KIND", "FILES", "STATUS"):
            table.add_column(column, no_wrap=column == "KEY")
        for r in results:
            status = (Text("CORRUPT", style="bold red") if not r["ok"] else Text("incompatible", style="yellow")
                      if r["incompatible"] else Text("ok", style="green"))
            table.add_row(r["key"], STORE_LABEL.get(r["store"], r["store"]), str(r["files_checked"]), status)
        stdout.print(table, highlight=False)
    for r in results:
        if r["incompatible"]:
            stderr.print(f"{r['key']}: {r['incompatible']}", highlight=False, soft_wrap=True)
    bad = [r for r in results if not r["ok"]]
    if bad:
        lines = [f"{r['key']}: {problem}" for r in bad for problem in r["problems"]]
        raise CacheCorruptError(f"{len(bad)} corrupt cache entr{'y' if len(bad) == 1 else 'ies'} in {where}: "
                                + "; ".join(lines) + f". {fix}")
    foreign = sum(1 for r in results if r["incompatible"])
    checked = len(results) - foreign
    stderr.print(f"{checked} entr{'y' if checked == 1 else 'ies'} in {where} verified, all intact"
                 + (f"; {foreign} of another Kiln or store left unchecked" if foreign else ""), highlight=False)


@cache_app.command("prune")
@friendly_errors
def prune(
    max_size: Annotated[str | None, typer.Option(help="Shrink to this size, least recently used first (50GB).")] = None,
    older_than: Annotated[str | None, typer.Option(help="Remove entries not used for this long (30d).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be removed; remove nothing.")] = False,
    remote: RemoteOpt = False,
    grace: Annotated[str | None, typer.Option(help="With --remote: keep entries used, and files written, more "
                                                   "recently than this (a pull or push may be in flight; default "
                                                   "1h).")] = None,
    cache_dir: CacheDirOpt = None, config: ConfigOpt = None, json_out: JsonOpt = False,
) -> None:
    """Remove old or least recently used entries (default: down to the configured limits), never one in use. With
    --remote (--older-than and/or --max-size), never one used within --grace, then the files no entry lists."""
    max_size_bytes = parse_size(max_size) if max_size else None
    older_than_s = parse_duration(older_than) if older_than else None
    if remote:
        cache_remote.prune(_remote_tier(cache_dir, config), max_size_bytes=max_size_bytes,
                           older_than_s=older_than_s, dry_run=dry_run,
                           grace_s=parse_duration(grace) if grace is not None else PRUNE_GRACE_S, json_out=json_out)
        return
    if grace is not None:
        raise CacheUsageError("--grace applies to --remote only: a local prune never removes an entry in use")
    report = cache_inspect.prune(_open(cache_dir, config), max_size_bytes=max_size_bytes,
                                 older_than_s=older_than_s, dry_run=dry_run)
    if json_out:
        print_json(report)
        return
    verb = "would remove" if dry_run else "removed"
    now = time.time()
    for entry in report["removed"]:
        last_used = format_ago(parse_iso(entry["last_used"]), now)
        stdout.print(f"{verb} {entry['key']} ({STORE_LABEL.get(entry['store'], entry['store'])}, "
                     f"{format_bytes(entry['size_bytes'])}, last used {last_used})", highlight=False, soft_wrap=True)
    for entry in report["in_use"]:
        stderr.print(f"kept {entry['key']}: in use by a running process", highlight=False, soft_wrap=True)
    if report["quarantined_removed"]:
        stdout.print(f"{verb} {entries_text(report['quarantined_removed'], 'quarantined')}", highlight=False)
    stderr.print(f"{'would free' if dry_run else 'freed'} {format_bytes(report['freed_bytes'])}", highlight=False)


@cache_app.command("rm")
@friendly_errors
def rm(key: KeyArg, cache_dir: CacheDirOpt = None, config: ConfigOpt = None, json_out: JsonOpt = False) -> None:
    """Remove one entry (refused while a running process holds it)."""
    report = cache_inspect.remove_entry(_open(cache_dir, config), key)
    if json_out:
        print_json(report)
        return
    stdout.print(f"removed {report['key']} ({format_bytes(report['freed_bytes'])} freed)", highlight=False,
                 soft_wrap=True)


@cache_app.command("push")
@friendly_errors
def push(
    key: Annotated[str | None, typer.Argument(help="The entry to upload (a key or a unique prefix), or --all.")] = None,
    all_entries: Annotated[bool, typer.Option("--all", help="Upload every engine and quantized checkpoint.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Upload again even when the remote has the entry (to "
                                                        "replace a damaged remote copy).")] = False,
    cache_dir: CacheDirOpt = None, config: ConfigOpt = None, json_out: JsonOpt = False,
) -> None:
    """Upload local entries to the remote cache, files first and the manifest last."""
    cache_remote.push(_open(cache_dir, config), key, all_entries=all_entries, force=force, json_out=json_out)


@cache_app.command("pull")
@friendly_errors
def pull(
    key: Annotated[str, typer.Argument(help="The remote entry (a key or a unique prefix, from `kiln cache ls "
                                            "--remote`).")],
    cache_dir: CacheDirOpt = None, config: ConfigOpt = None, json_out: JsonOpt = False,
) -> None:
    """Install a remote entry in the local cache; every file's sha256 is checked first (exit 3 if damaged)."""
    cache_remote.pull(lambda: _open(cache_dir, config, create=True), _remote_tier(cache_dir, config), key,
                      json_out=json_out)


def print_explain(report: dict, json_out: bool) -> None:
    """Print ``engines.cache.inspect.explain``'s report: the nearest entry and each field that differs from it, and
    whether the remote has the engine."""
    if json_out:
        print_json(report)
        return
    if (remote := report.get("remote")) is not None:
        has = {True: "has this engine: a build pulls it", False: "does not have this engine",
               None: f"could not be asked ({remote.get('error')})"}[remote["has_entry"]]
        stdout.print(f"remote {remote['url']} {has}", highlight=False, soft_wrap=True)
    if report["nearest_key"] is None:
        stdout.print("the cache has no entries to compare with", highlight=False)
        return
    if not report["differences"]:
        stdout.print(f"identical key material: entry {report['nearest_key']} would be a hit", highlight=False)
        return
    stdout.print(f"nearest entry {report['nearest_key']} (created {report['created']}) differs in:", highlight=False)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("FIELD", "ENTRY", "CONFIG"):
        table.add_column(column)
    for diff in report["differences"]:
        table.add_row(diff["field"], json.dumps(diff["entry"]), json.dumps(diff["config"]))
    stdout.print(table, highlight=False)
