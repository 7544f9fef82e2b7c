"""CPU time of the processes a load test involves, to say which of them a served token costs most (Linux: read from
``/proc``; elsewhere only this process's own)."""

from __future__ import annotations

import os
import resource
from pathlib import Path


def cpu_seconds(pid: int | None = None) -> float | None:
    """User plus system CPU seconds a process has used: this one when ``pid`` is None; None where it cannot be read."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime and stime, in clock ticks
