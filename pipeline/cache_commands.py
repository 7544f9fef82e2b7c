"""``kiln cache``: ls, show, stats, verify, prune, rm. Tables for a person on stdout, ``--json`` for a machine;
notes on stderr."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kiln.engines.cache import CacheCorruptError, EngineCache
from kiln.engines.cache import inspect as cache_inspect
from kiln.engines.cache.units import (
    format_ago,
    format_bytes,
    format_seconds,
    parse_duration,
    parse_iso,
    parse_since,
    parse_size,
)
from kiln.pipeline.config import cache_root, load_config
from kiln.pipeline.console import friendly_errors, print_json, stderr, stdout

cache_app = typer.Typer(help="Inspect and maintain the engine cache.", no_args_is_help=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable object on stdout.")]
KeyArg = Annotated[str, typer.Argument(help="A cache key (64 hex characters, as `kiln cache ls` prints it) or a "
                                              "unique prefix of at least 4.")]
CacheDirOpt = Annotated[Path | None, typer.Option(
    "--cache-dir", help="The cache root (default: $KILN_CACHE, else the --config's cache.dir, else ~/.cache/kiln).")]
ConfigOpt = Annotated[str | None, typer.Option("--config", help="Take the cache root from this config file.")]

PIPE_WIDTH = 240
_STORE_LABEL = {"entries": "engine", "quantized": "quantized", "checkpoints": "generated"}


def _open(cache_dir: Path | None, config: str | None) -> EngineCache:
    """The cache named by --cache-dir, else by the config (``$KILN_CACHE`` overrides its cache.dir), else default."""
    if cache_dir is not None:
        root = cache_dir.expanduser()
    elif config is not None:
        root = load_config(config).config.cache.root()
    else:
        root = cache_root()
    return EngineCache.open_configured(root)


def _print_table(table: Table) -> None:
    """Print a table with full 64-character keys: at the terminal's width, or unsqueezed when piped."""
    (stdout if stdout.is_terminal else Console(width=PIPE_WIDTH, file=stdout.file)).print(table, highlight=False)


def _ago(iso: str | None) -> str:
    return format_ago(parse_iso(iso))


@cache_app.command("ls")
@friendly_errors
def ls(cache_dir: CacheDirOpt = None, config: ConfigOpt = None, json_out: JsonOpt = False) -> None:
    """One row per entry, most recently used first: key, model, format, backend, GPU, size, created, last used, hits."""
    cache = _open(cache_dir, config)
    rows = cache_inspect.ls_entries(cache)
    if json_out:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("KEY", "KIND", "MODEL", "FORMAT", "BACKEND", "GPU", "SIZE", "CREATED", "LAST USED", "HITS"):
        table.add_column(column, no_wrap=column == "KEY", justify="right" if column in ("SIZE", "HITS") else "left")
    for row in rows:
        table.add_row(row["key"], _STORE_LABEL.get(row["store"], row["store"]), row["model"] or "-",
                      row["format"] or "-", row["backend"] or "-", row["gpu"] or "-", format_bytes(row["size_bytes"]),
                      _ago(row["created"]), _ago(row["last_used"]), str(row["hits"]))
    if rows:
        _print_table(table)
    total = sum(row["size_bytes"] for row in rows)
    stderr.print(f"{len(rows)} entries, {format_bytes(total)} in {cache.root}", highlight=False)


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
        ("key", entry["key"]), ("kind", _STORE_LABEL.get(entry["store"], entry["store"])),
        ("path", entry["payload_dir"]),
        *((name, str(describe[name])) for name in ("model", "format", "backend", "gpu") if describe.get(name)),
        ("size", format_bytes(entry["size_bytes"])), ("created", f"{entry['created']} ({_ago(entry['created'])})"),
        ("last used", f"{entry['last_used']} ({_ago(entry['last_used'])})"), ("hits", str(entry["hits"])),
        ("in use", "yes" if entry["in_use"] else "no"),
        ("build time", format_seconds(entry["build_seconds"] or 0)),
    ):
        facts.add_row(label, value)
    _print_table(facts)
    stdout.print("\n[bold]key material[/]")
    stdout.print_json(json.dumps(entry["material"]))
    files = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("FILE", "SIZE", "SHA256"):
        files.add_column(column, justify="right" if column == "SIZE" else "left")
    for item in entry["files"]:
        files.add_row(item["path"], format_bytes(item["size"]), item["sha256"])
    stdout.print("\n[bold]files[/]")
    _print_table(files)
    stdout.print("\n[bold]build record[/]")
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
    rate = report["hit_rate"]
    reasons = ", ".join(f"{n} {reason}" for reason, n in report["misses_by_reason"].items() if n)
    load = report["load_ms"]
    table.add_row("lookups", str(report["lookups"]), f"since {report['since']}" if report["since"] else "")
    table.add_row("hits", str(report["hits"]), f"{rate:.1%} hit rate" if rate is not None else "")
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
    for name in ("quantized", "checkpoints"):  # the checkpoint stores, when used
        store = report["stores"][name]
        if store["lookups"] or store["entries"]:
            rate = f", {store['hit_rate']:.1%}" if store["hit_rate"] is not None else ""
            table.add_row(_STORE_LABEL[name], f"{store['hits']}/{store['lookups']} hits{rate}",
                          f"{store['entries']} checkpoints, {format_bytes(store['size_bytes'])}")
    stdout.print(table, highlight=False)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


@cache_app.command("verify")
@friendly_errors
def verify(
    key: Annotated[str | None, typer.Argument(help="The entry to re-hash (or --all).")] = None,
    all_entries: Annotated[bool, typer.Option("--all", help="Re-hash every entry.")] = False,
    cache_dir: CacheDirOpt = None, config: ConfigOpt = None, json_out: JsonOpt = False,
) -> None:
    """Re-hash entries against their manifests; exit 3 naming each corrupt file (the entry is then rebuilt)."""
    results = cache_inspect.verify_entries(_open(cache_dir, config), key, all_entries=all_entries)
    if json_out:
        print_json(results)
    else:
        table = Table(box=None, header_style="bold", pad_edge=False)
        for column in ("KEY", "KIND", "FILES", "STATUS"):
            table.add_column(column, no_wrap=column == "KEY")
        for r in results:
            status = "[green]ok[/]" if r["ok"] else "[bold red]CORRUPT[/]"
            table.add_row(r["key"], _STORE_LABEL.get(r["store"], r["store"]), str(r["files_checked"]), status)
        _print_table(table)
    bad = [r for r in results if not r["ok"]]
    if bad:
        lines = [f"{r['key']}: {problem}" for r in bad for problem in r["problems"]]
        raise CacheCorruptError(f"{len(bad)} corrupt cache entr{'y' if len(bad) == 1 else 'ies'}: "
                                + "; ".join(lines) + ". They are marked corrupt: the next build rebuilds them "
                                "(or remove them with `kiln cache rm KEY`)")
    stderr.print(f"{len(results)} entr{'y' if len(results) == 1 else 'ies'} verified, all intact")


@cache_app.command("prune")
@friendly_errors
def prune(
    max_size: Annotated[str | None, typer.Option(help="Shrink to this size, least recently used first (50GB).")] = None,
    older_than: Annotated[str | None, typer.Option(help="Remove entries not used for this long (30d).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be removed; remove nothing.")] = False,
    cache_dir: CacheDirOpt = None, config: ConfigOpt = None, json_out: JsonOpt = False,
) -> None:
    """Remove old or least recently used entries (default: down to the configured limits), never one in use."""
    report = cache_inspect.prune(_open(cache_dir, config), max_size_bytes=parse_size(max_size) if max_size else None,
                                 older_than_s=parse_duration(older_than) if older_than else None, dry_run=dry_run)
    if json_out:
        print_json(report)
        return
    verb = "would remove" if dry_run else "removed"
    now = time.time()
    for entry in report["removed"]:
        last_used = format_ago(parse_iso(entry["last_used"]), now)
        stdout.print(f"{verb} {entry['key']} ({_STORE_LABEL.get(entry['store'], entry['store'])}, "
                     f"{format_bytes(entry['size_bytes'])}, last used {last_used})", highlight=False, soft_wrap=True)
    for entry in report["in_use"]:
        stderr.print(f"kept {entry['key']}: in use by a running process", highlight=False, soft_wrap=True)
    if report["quarantined_removed"]:
        stdout.print(f"{verb} {report['quarantined_removed']} quarantined entries", highlight=False)
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


def print_explain(report: dict, json_out: bool) -> None:
    """Print ``engines.cache.inspect.explain``'s report: the nearest entry and each field that differs from it."""
    if json_out:
        print_json(report)
        return
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
    _print_table(table)
