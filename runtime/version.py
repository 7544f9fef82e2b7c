"""Installed packages' versions: Kiln's own and those an engine's fingerprint or toolchain records."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# how to add the serve extra (the server's and kiln loadtest's packages) to an install: from Kiln's own source,
# since PyPI's "kiln" is an unrelated project
SERVE_EXTRA_INSTALL = "pip install '.[serve]' in Kiln's checkout, or 'path/to/kiln-VERSION-py3-none-any.whl[serve]'"


def package_version(distribution: str) -> str | None:
    """The installed ``distribution``'s version; None when it is not installed."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def kiln_version() -> str | None:
    """The installed package's version; None when Kiln runs from a checkout that was never installed."""
    return package_version("kiln")


def version_line() -> str:
    """What ``kiln --version`` prints."""
    return f"kiln {kiln_version() or '(not installed: run from a checkout)'}"
