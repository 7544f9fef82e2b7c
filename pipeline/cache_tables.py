"""How the cache commands print for a person: tables with whole keys, kinds of entry, times ago."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from kiln.engines.cache.units import format_ago, format_bytes, parse_iso

STORE_LABEL = {"entries": "engine", "quantized": "quantized", "checkpoints": "generated"}


def ago(iso: str | None) -> str:
    return format_ago(parse_iso(iso))


def entries_table(rows: list[dict]) -> Table:
    """One line per entry row (``kiln cache ls``, local or ``--remote``): key, kind, model, format, backend, GPU,
    size (or "damaged" for a remote entry with a ``problem``), created, last used, and hits where rows count them
    (a remote's rows have ``hits`` None)."""
    hits = any(row["hits"] is not None for row in rows)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("KEY", "KIND", "MODEL", "FORMAT", "BACKEND", "GPU", "SIZE", "CREATED", "LAST USED",
                   *(("HITS",) if hits else ())):
        table.add_column(column, no_wrap=column == "KEY", justify="right" if column in ("SIZE", "HITS") else "left")
    for row in rows:
        size = Text("damaged", style="red") if row["problem"] else format_bytes(row["size_bytes"])
        kv = f", kv {row['kv_cache_dtype']}" if row["kv_cache_dtype"] not in (None, "auto") else ""
        table.add_row(row["key"], STORE_LABEL.get(row["store"], row["store"]), row["model"] or "-",
                      f"{row['format'] or '-'}{kv}", row["backend"] or "-", row["gpu"] or "-", size,
                      ago(row["created"]), ago(row["last_used"]), *((str(row["hits"]),) if hits else ()))
    return table


def entries_text(count: int, kind: str = "") -> str:
    """``1 entry``, ``3 entries`` (``kind``: a word before the noun, ``2 quarantined entries``)."""
    return f"{count} {kind + ' ' if kind else ''}{'entry' if count == 1 else 'entries'}"


def rate(size: int, seconds: float) -> str:
    """``12.3 MB/s`` of ``size`` bytes moved in ``seconds`` ("-" when either is zero)."""
    return f"{format_bytes(int(size / seconds))}/s" if size and seconds > 0 else "-"
