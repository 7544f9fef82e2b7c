"""Kiln's own version, as installed."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kiln_version() -> str | None:
    """The installed package's version; None when Kiln runs from a checkout that was never installed."""
    try:
        return version("kiln")
    except PackageNotFoundError:
        return None
