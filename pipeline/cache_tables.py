"""How the cache commands print for a person: tables with whole keys, kinds of entry, times ago."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kiln.engines.cache.units import format_ago, parse_iso
from kiln.pipeline.console import stdout

PIPE_WIDTH = 240
STORE_LABEL = {"entries": "engine", "quantized": "quantized", "checkpoints": "generated"}


def print_table(table: Table) -> None:
    """Print a table with full 64-character keys: at the terminal's width, or unsqueezed when piped."""
    (stdout if stdout.is_terminal else Console(width=PIPE_WIDTH, file=stdout.file)).print(table, highlight=False)


def ago(iso: str | None) -> str:
    return format_ago(parse_iso(iso))
