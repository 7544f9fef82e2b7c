"""Run one TensorRT-LLM command: output to log files, a deadline, and the whole process group stopped on timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kiln.runtime.errors import KilnError

TAIL_LINES = 40
TAIL_CHARS = 4000
KILL_GRACE_S = 10.0


class TrtllmBuildError(KilnError):
    """A TensorRT-LLM command failed, timed out, or could not start; `record` holds what it printed."""

    exit_code = 3

    def __init__(self, message: str, record: dict | None = None) -> None:
        super().__init__(message)
        self.record = record


@dataclass
class ProcessRecord:
    """What a command did: argv, exit status, wall time and the tails of its output (full logs: file names in the
    log folder)."""

    argv: list[str]
    returncode: int | None
    seconds: float
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    stdout_log: str
    stderr_log: str

    def to_dict(self) -> dict:
        return asdict(self)


def run_logged(argv: list[str], *, name: str, log_dir: Path, timeout_s: float, env: dict[str, str] | None = None,
               cwd: Path | None = None, budget_s: float | None = None) -> ProcessRecord:
    """Run `argv` to completion or `timeout_s`, whichever is first; stdout and stderr go to `log_dir/<name>.*.log`.
    `budget_s` is the whole time budget to name in a timeout message (default `timeout_s`).

    Raises TrtllmBuildError when it cannot start, exits non-zero, or runs out of time (then its process group,
    MPI ranks and build workers included, gets SIGTERM and, after a grace period, SIGKILL)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / f"{name}.stdout.log", log_dir / f"{name}.stderr.log"
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                    start_new_session=True)
        except OSError as e:
            raise TrtllmBuildError(f"{argv[0]} could not be started ({e.strerror or e}); install TensorRT-LLM 1.2.x "
                                   f"so that it is on PATH (see docs/tensorrt-llm.md)") from None
        timed_out = False
        try:
            proc.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_group(proc)
    record = ProcessRecord(argv=list(argv), returncode=proc.returncode, seconds=round(time.monotonic() - start, 3),
                           timed_out=timed_out, stdout_tail=_tail(out_path), stderr_tail=_tail(err_path),
                           stdout_log=out_path.name, stderr_log=err_path.name)
    if timed_out:
        raise TrtllmBuildError(f"{name} did not finish within {budget_s or timeout_s:.0f} s and was stopped; raise "
                               f"build.timeout_s or lower the build limits{_last_line(record)}", record.to_dict())
    if proc.returncode != 0:
        raise TrtllmBuildError(f"{name} failed with exit status {proc.returncode} after {record.seconds:.1f} s"
                               f"{_last_line(record)}", record.to_dict())
    return record


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path) -> str:
    text = path.read_bytes()[-TAIL_CHARS * 4:].decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-TAIL_LINES:])[-TAIL_CHARS:]


def _last_line(record: ProcessRecord) -> str:
    lines = [line.strip() for line in (record.stderr_tail or record.stdout_tail).splitlines() if line.strip()]
    return f": {lines[-1]}" if lines else ""
