"""What produced a benchmark's figures: its ``run`` object (Kiln's version and the checkout's commit, the libraries
that set them, the machine, when, and the command line) and its ``runtime`` object (the runtime options it ran with),
so that a figure can be read next to its run."""

from __future__ import annotations

import platform
import shlex
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from kiln.pipeline.runtime_env import OPTION_VARIABLES
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.version import kiln_version, package_version

PACKAGE_DIR = Path(__file__).resolve().parents[2]


def run_record() -> dict:
    """The ``run`` object of a bench or loadtest report; call it when the command starts."""
    return {"kiln": kiln_version(), "checkout": checkout_commit(PACKAGE_DIR), "python": platform.python_version(),
            **{name: package_version(name) for name in ("torch", "transformers", "triton")},
            "host": socket.gethostname(), "platform": platform.platform(), "cpu": cpu_model(),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": shlex.join(["kiln", *redacted(sys.argv[1:])])}


def runtime_record(options: RuntimeOptions) -> dict:
    """The ``runtime`` object of a bench, suite or loadtest report: the options of ``options`` that ``KILN_*``
    variables set (``OPTION_VARIABLES``) and that are not at their defaults (set by one, or by a suite), by
    ``RuntimeOptions`` name; {} at the defaults."""
    defaults = RuntimeOptions()
    return {name: getattr(options, name) for name in OPTION_VARIABLES
            if getattr(options, name) != getattr(defaults, name)}


SECRET_OPTIONS = ("--api-key",)  # what a report, meant to be shared, never shows


def redacted(argv: list[str]) -> list[str]:
    """``argv`` with the values of SECRET_OPTIONS (``--api-key K`` or ``--api-key=K``) written as ``***``."""
    out, hide = [], False
    for arg in argv:
        option, equals, _ = arg.partition("=")
        out.append("***" if hide else f"{option}=***" if equals and option in SECRET_OPTIONS else arg)
        hide = not hide and arg in SECRET_OPTIONS
    return out


def checkout_commit(directory: Path) -> str | None:
    """The commit of the git checkout Kiln runs from (``+changes`` where its files differ from it); None outside
    one (an installed wheel, even in another project's checkout), or without git."""
    try:
        top = subprocess.run(["git", "-C", str(directory), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        if Path(top).resolve() != directory.resolve():  # a checkout around Kiln's folder: not Kiln's own
            return None
        commit = subprocess.run(["git", "-C", str(directory), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=5, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}{'+changes' if changed else ''}"


def cpu_model() -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo; the platform's processor elsewhere)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        cpuinfo = ""
    model = next((line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 None)
    return model or platform.processor() or None
