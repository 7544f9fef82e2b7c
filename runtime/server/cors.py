"""The origins browsers may call the server from (CORS), each checked and spelt as a browser's Origin header spells
it: CORS matches them exactly, so an origin written otherwise would never match."""

from __future__ import annotations

import re
from collections.abc import Iterable

from kiln.runtime.errors import KilnError

_ORIGIN = re.compile(r"\*|[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+")  # as a browser's Origin header: no path
_DEFAULT_PORTS = {"http": "80", "https": "443"}  # which browsers leave out of an Origin header


class AllowedOriginsError(KilnError):
    """An allowed origin that is not one, or that no browser's Origin header could ever match."""


def browser_origins(origins: Iterable[str]) -> tuple[str, ...]:
    """Each of ``origins`` as browsers send it (``browser_origin``)."""
    return tuple(browser_origin(origin) for origin in origins)


def browser_origin(origin: str) -> str:
    """``origin`` ('*' or scheme://host[:port]) as browsers send it: scheme and host in lowercase, a non-ASCII host
    IDNA-encoded (punycode), without the scheme's default port; AllowedOriginsError for what is not an origin or
    names a '*' inside its host (browsers send exact origins, and CORS matches them exactly)."""
    if not isinstance(origin, str) or not _ORIGIN.fullmatch(origin):
        raise AllowedOriginsError(f"{origin!r} is not an origin; give '*' or scheme://host[:port] with no path or "
                                  f"trailing slash (https://app.example)")
    if origin == "*":
        return origin
    scheme, _, netloc = origin.partition("://")
    if "*" in netloc:
        raise AllowedOriginsError(f"{origin!r}: a '*' inside a host never matches (CORS compares a browser's Origin "
                                  f"exactly); list each origin (https://app.example.com), or give '*' alone")
    host, colon, port = netloc.rpartition(":")
    if not colon or not port.isdigit():  # no port (an IPv6 host's colons are inside its brackets)
        host, port = netloc, ""
    try:
        host = host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise AllowedOriginsError(f"{origin!r}: {host!r} is not a host name; give scheme://host[:port] "
                                  f"(https://app.example)") from None
    scheme = scheme.lower()
    keep_port = port and port != _DEFAULT_PORTS.get(scheme)
    return f"{scheme}://{host}" + (f":{port}" if keep_port else "")
