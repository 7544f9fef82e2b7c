"""Terminal output: progress on stderr, results on stdout, and one clean line per user error."""

from __future__ import annotations

import contextlib
import contextvars
import errno
import functools
import io
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

from kiln.calibration.errors import CalibrationError
from kiln.runtime.errors import KilnError

# Wrapped at the terminal's width for people; not wrapped into a pipe or a file (text not at all, tables at
# PIPE_WIDTH), where a path or a key split over two lines breaks whatever reads it. Text is printed as it is (a path
# or a message may hold "[...]"): styled lines ask for markup (``markup=True``) and escape what they insert.
PIPE_WIDTH = 240
stdout = Console(markup=False, emoji=False)
stderr = Console(stderr=True, markup=False, emoji=False)
for _console in (stdout, stderr):
    if not _console.is_terminal:
        _console.soft_wrap, _console.width = True, PIPE_WIDTH


class Terminated(KeyboardInterrupt):
    """SIGTERM (CI cancelling a job, Kubernetes stopping a pod), taken as Ctrl-C is, so that what a command was
    writing is removed as an interrupted one's is; the command then exits 143, as one the signal ended."""


_terminated = threading.Event()  # SIGTERM came: an exception raised where Python drops it (a weakref callback, a
# __del__) must not let the command finish as if it had not


def _raise_terminated(_signum: int, _frame: object) -> None:
    _terminated.set()
    raise Terminated


def stop_on_sigterm_as_on_ctrl_c() -> None:
    """From now on, SIGTERM in this process raises ``Terminated`` in its main thread (``friendly_errors`` says so
    and exits 143)."""
    signal.signal(signal.SIGTERM, _raise_terminated)


_printed_json: contextvars.ContextVar[bool] = contextvars.ContextVar("printed_json", default=False)
_stdout_undo: list[Callable[[], None]] = []  # while a command runs: what gives its stdout back (give_stdout_back)
_lines_logged: list[bool] = []  # while a command runs (friendly_errors): whether its lines are log lines now


def print_json(data: Any) -> None:
    """A stable machine-readable object on stdout."""
    stdout.file.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    stdout.file.flush()
    _printed_json.set(True)


@contextmanager
def stdout_kept_for_results() -> Iterator[None]:
    """While a command runs, results (``print_json``, the ``stdout`` console) keep stdout and anything else written
    there goes to stderr: modelopt's "Loading extension ..." when it compiles its CUDA kernels, or output from C, would
    otherwise break ``--json``. Where stdout has no file descriptor (typer's test runner) only Python's writes move."""
    results = original = sys.stdout
    results.flush()
    try:
        fd = results.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        fd = None
    saved = None
    if fd is not None:
        saved = os.dup(fd)
        results = os.fdopen(saved, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors,
                            closefd=False)
        os.dup2(sys.stderr.fileno(), fd)
    stdout.file = results

    def undo() -> None:
        sys.stdout.flush()
        if saved is not None:
            os.dup2(saved, fd)
        sys.stdout = original

    _stdout_undo.append(undo)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        _stdout_undo.remove(undo)
        stdout.file = None
        if saved is None:
            results.flush()
        else:
            results.close()  # flushes; closefd=False leaves the descriptor to os.close
            sys.stdout.flush()
            os.dup2(saved, fd)
            os.close(saved)


def give_stdout_back() -> None:
    """Undo ``stdout_kept_for_results`` for the rest of the command: stdout is stdout again, in this process and in
    those it starts (a server whose logging configuration file writes its lines there). Outside a command, nothing."""
    if _stdout_undo:
        _stdout_undo[-1]()


def log_lines_instead() -> None:
    """For the rest of the command running (``friendly_errors``), the lines it prints for a person are log lines
    (``logged_instead``): ``kiln serve --log-config``'s, where a logging configuration file says where every line
    goes. Commands run after it in this process print theirs again. Outside a command, nothing."""
    if _lines_logged:
        _lines_logged[-1] = True


def _lines_are_logged() -> bool:
    return bool(_lines_logged) and _lines_logged[-1]


def logged_instead(level: int, message: str) -> bool:
    """Where the command's lines are log lines (``log_lines_instead``), log ``message`` at ``level`` (logger
    ``kiln.pipeline``) and return True; else False: the caller prints it on stderr."""
    if not _lines_are_logged():
        return False
    logging.getLogger("kiln.pipeline").log(level, message)
    return True


def friendly_errors(command: Callable) -> Callable:
    """Turn user-caused errors into one red line on stderr and a non-zero exit (and, under ``--json``, an
    ``{"error": {"type", "message"}}`` object on stdout unless the command printed its result before failing, as
    ``cache verify`` does); bugs keep their traceback. The command runs with ``stdout_kept_for_results``."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        _printed_json.set(False)
        _terminated.clear()
        _lines_logged.append(False)
        try:
            with stdout_kept_for_results():
                result = command(*args, **kwargs)
            if _terminated.is_set():  # the Terminated raised was dropped where it landed
                raise Terminated
            return result
        except (KilnError, CalibrationError) as exc:
            _fail(type(exc).__name__, str(exc), kwargs.get("json_out"), getattr(exc, "details", None))
            raise typer.Exit(getattr(exc, "exit_code", 2)) from None
        except PermissionError as exc:  # a file or folder this user may not read or write: the machine's, not a bug
            where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else exc.filename  # a rename's both ends
            _fail("PermissionError", f"{where}: {exc.strerror}; give this user access to it (chmod, chown), "
                                     f"or point Kiln at a copy it can read and write", kwargs.get("json_out"))
            raise typer.Exit(2) from None
        except OSError as exc:
            if (message := write_failure(exc)) is None:
                raise
            with contextlib.suppress(OSError):  # stderr may be the full disk too
                _fail("OSError", message, kwargs.get("json_out") and exc.filename is not None)  # stdout failed: no JSON
            raise typer.Exit(2) from None
        except KeyboardInterrupt as exc:
            _stop_interrupted(exc, kwargs.get("json_out"))
        except Exception:
            if not _terminated.is_set():  # a bug: its traceback
                raise
            # SIGTERM landed where Python wraps what it raised (an import's __set_name__: a RuntimeError)
            _stop_interrupted(Terminated(), kwargs.get("json_out"))
        finally:
            _lines_logged.pop()

    return wrapper


def _stop_interrupted(exc: KeyboardInterrupt, json_out: bool | None) -> NoReturn:
    """Say that Ctrl-C or SIGTERM (``Terminated``) stopped the command, and exit 130 or 143."""
    terminated = isinstance(exc, Terminated)
    message = "terminated (SIGTERM)" if terminated else "interrupted"
    if not logged_instead(logging.WARNING, message):
        stderr.print(f"[yellow]{message}[/]", markup=True)
    if json_out and not _printed_json.get():
        print_error_json(type(exc).__name__, message)
    raise typer.Exit(143 if terminated else 130) from None


def write_failure(exc: OSError) -> str | None:
    """The one line for a write the machine refused (a full disk, a quota, a file-size limit, an I/O error): output
    redirected to a full disk (``> /dev/full``) among them; None for any other error."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
        return None
    return f"cannot write {exc.filename or 'the output'}: {exc.strerror}"


def _fail(kind: str, message: str, json_out: bool | None, details: dict | None = None) -> None:
    """One red error line on stderr (a log line where a logging configuration file applies), and under ``--json``
    (unless the result is out already) the error object."""
    if not logged_instead(logging.ERROR, message):
        stderr.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)
    if json_out and not _printed_json.get():  # a script reading stdout gets the error too
        print_error_json(kind, message, details)


def print_error_json(kind: str, message: str, details: dict | None = None) -> None:
    """The ``{"error": {"type", "message"}}`` object a command given ``--json`` prints on stdout when it fails (with
    the error's ``details`` where it has them: a failed gate's attempts, their rounds and metrics)."""
    print_json({"error": {"type": kind, "message": message, **({"details": details} if details else {})}})


def warn(message: str) -> None:
    """One yellow warning line on stderr (a remote cache that failed while the build goes on locally, say); a log
    line where a logging configuration file applies."""
    if not logged_instead(logging.WARNING, message):
        stderr.print(f"[yellow]warning:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)


def _progress_lines(name: str) -> Callable[[str, float], None]:
    last = ""

    def report(message: str, _fraction: float) -> None:
        nonlocal last
        if message and message != last:
            last = message
            if not logged_instead(logging.INFO, f"{name}: {message}"):
                stderr.print(f"{name:<9} {message}", highlight=False, markup=False)

    return report


@contextmanager
def stage_progress(enabled: bool) -> Iterator[Callable[[str], Callable[[str, float], None]]]:
    """Yield a factory of per-stage progress callbacks ``(message, fraction)``: bars on a terminal's stderr; else
    (stderr a log or a pipe, bars not wanted, or the command's lines log lines: ``log_lines_instead``) each new
    message as one line there (or a log line), so a log still says what happened and why a build waited."""
    if not enabled or not stderr.is_terminal or _lines_are_logged():
        yield _progress_lines
        return
    columns = (TextColumn("{task.fields[stage]:<9}"), BarColumn(), TextColumn("{task.description}", markup=False),
               TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=False) as progress:

        def factory(name: str) -> Callable[[str, float], None]:
            task = progress.add_task("", total=1.0, stage=name)

            def report(message: str, fraction: float) -> None:
                progress.update(task, description=message, completed=max(0.0, min(1.0, fraction)))

            return report

        yield factory


@contextmanager
def transfer_bars() -> Iterator[Callable[[str], Callable[[str, int, int], None] | None]]:
    """Yield a factory of byte-progress callbacks ``(verb, done, total)``, one bar per label, with the transfer
    rate: on a terminal's stderr only, where the command's lines are not log lines (``log_lines_instead``: a log gets
    the command's summary lines instead)."""
    if not stderr.is_terminal or _lines_are_logged():
        yield lambda _label: None
        return
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=False) as progress:

        def factory(label: str) -> Callable[[str, int, int], None]:
            task = None

            def told(verb: str, done: int, total: int) -> None:
                nonlocal task
                if task is None:
                    task = progress.add_task(f"{verb} {label}", total=total)
                progress.update(task, completed=done, total=total)

            return told

        yield factory
