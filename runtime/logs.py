"""Kiln's log lines on stderr, in one format for every process of a server (the HTTP server's and the engine's):
time, level, logger, the id of the request they concern ("-" for none), message. Light to import: the engine process
imports it, not the server."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


def stderr_log_handler() -> logging.Handler:
    """A handler of log lines on stderr in ``LOG_FORMAT``; a record with no ``request_id`` shows "-"."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, defaults={"request_id": "-"}))
    return handler


def log_to_stderr(level: int | str, handler: logging.Handler | None = None) -> None:
    """Kiln's own log lines (the ``kiln`` logger's) from ``level`` up on stderr, through ``handler`` (default:
    ``stderr_log_handler()``) unless one is attached already (set up earlier in this process)."""
    kiln_logger = logging.getLogger("kiln")
    if not kiln_logger.handlers:
        kiln_logger.addHandler(handler or stderr_log_handler())
    kiln_logger.setLevel(level)


def level_for_child() -> str:
    """Kiln's log level in this process, passed to a process it starts (``log_as_parent`` there)."""
    return str(logging.getLogger("kiln").level)


def log_as_parent(level: int) -> None:
    """Log as the process that started this one: from its ``level`` up on stderr, or, where it set none (NOTSET),
    with no handler added (an embedder's logging stays its own)."""
    if level != logging.NOTSET:
        log_to_stderr(level)
