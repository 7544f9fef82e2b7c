"""Parsing and printing of sizes, durations and times for the cache commands (``50GB``, ``30d``, ``3h ago``)."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

from kiln.engines.cache.errors import CacheUsageError

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*", re.IGNORECASE)
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """Bytes in ``50GB``, ``1.5T``, ``500MiB``, ``1024B`` or ``0`` (SI units are powers of 1000, ``KiB``... of 1024).
    A number without a unit other than 0 is refused: ``50`` reads as gigabytes to some (``cache.max_size_gb``,
    ccache's ``-M``) and as bytes to others, and as bytes it would prune everything."""
    match = _SIZE_RE.fullmatch(text)
    if not match or (match.group(3) and not match.group(2)):
        raise CacheUsageError(f"size {text!r} is not understood; write it like 50GB, 500MB or 2TiB")
    number, prefix, binary, byte = match.groups()
    if not (prefix or byte) and float(number) != 0:
        raise CacheUsageError(f"size {text!r} has no unit; write {number}GB for gigabytes (or {number}B for bytes)")
    base = 1024 if binary else 1000
    return int(float(number) * base ** _POWERS[prefix.lower()])


def parse_duration(text: str) -> float:
    """Seconds in ``30d``, ``12h``, ``45m``, ``90s`` or ``2w``."""
    match = _DURATION_RE.fullmatch(text)
    if not match:
        raise CacheUsageError(f"duration {text!r} is not understood; write it like 30d, 12h, 45m or 2w")
    return float(match.group(1)) * _SECONDS[match.group(2).lower()]


def parse_since(text: str) -> float:
    """A point in time as a unix timestamp: a duration back from now (``7d``) or an ISO date/time (UTC if bare)."""
    moment = _since(text)
    try:
        datetime.fromtimestamp(moment, UTC)  # as iso_utc prints it
    except (ValueError, OverflowError, OSError):
        raise CacheUsageError(f"--since {text!r} reaches back before the year 1; give a shorter duration, or leave "
                              "--since out to count every event") from None
    return moment


def _since(text: str) -> float:
    """``parse_since`` before its range check."""
    if _DURATION_RE.fullmatch(text):
        return time.time() - parse_duration(text)
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise CacheUsageError(f"--since {text!r} is not understood; write a duration (7d, 12h) or a date "
                              "(2025-01-31)") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def format_bytes(n: int | None) -> str:
    """``1.2 GB`` style (powers of 1000, as ``parse_size`` reads them)."""
    if n is None:
        return "unbounded"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def format_ago(timestamp: float | None, now: float | None = None) -> str:
    """How long ago, roughly: ``just now``, ``5 minutes ago``, ``3 days ago``."""
    if timestamp is None:
        return "-"
    delta = max(0.0, (now if now is not None else time.time()) - timestamp)
    for unit, size in (("week", 7 * 86400), ("day", 86400), ("hour", 3600), ("minute", 60)):
        if delta >= size:
            count = int(delta // size)
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "just now"


def iso_utc(timestamp: float) -> str:
    """``2025-01-31T12:00:00Z``."""
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_iso(text: str | None) -> float | None:
    """The unix time of an ISO timestamp written by ``iso_utc`` (None when absent or malformed)."""
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else None
    except ValueError:
        return None
