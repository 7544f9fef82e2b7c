"""Installed packages' versions: Kiln's own and those an engine's fingerprint or toolchain records."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version(distribution: str) -> str | None:
    """The installed ``distribution``'s version; None when it is not installed."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def kiln_version() -> str | None:
    """The installed package's version; None when Kiln runs from a checkout that was never installed."""
    return package_version("kiln")
