"""Terminal output: progress on stderr, results on stdout, and one clean line per user error."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from calibration.errors import CalibrationError
from runtime.errors import KilnError

stdout = Console()
stderr = Console(stderr=True)


def print_json(data: Any) -> None:
    """A stable machine-readable object on stdout."""
    stdout.file.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    stdout.file.flush()


def keep_stdout_for_results() -> None:
    """Give results a private copy of this process's stdout and point file descriptor 1 at stderr, so that what
    libraries print (modelopt's "Loading extension ..." when it compiles its CUDA kernels, a compiler's output from
    C) lands on stderr and ``--json`` stays one parseable object."""
    sys.stdout.flush()
    stdout.file = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


def friendly_errors(command: Callable) -> Callable:
    """Turn user-caused errors into one red line on stderr and a non-zero exit; bugs keep their traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (KilnError, CalibrationError) as exc:
            stderr.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(getattr(exc, "exit_code", 2)) from None
        except KeyboardInterrupt:
            stderr.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper


@contextmanager
def stage_progress(enabled: bool) -> Iterator[Callable[[str], Callable[[str, float], None]]]:
    """Yield a factory of per-stage progress callbacks ``(message, fraction)`` drawing bars on stderr."""
    if not enabled:
        yield lambda _name: (lambda *_: None)
        return
    columns = (TextColumn("{task.fields[stage]:<9}"), BarColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=False) as progress:

        def factory(name: str) -> Callable[[str, float], None]:
            task = progress.add_task("", total=1.0, stage=name)

            def report(message: str, fraction: float) -> None:
                progress.update(task, description=message, completed=max(0.0, min(1.0, fraction)))

            return report

        yield factory
