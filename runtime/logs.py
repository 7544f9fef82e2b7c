"""Kiln's log lines on stderr, in one format for every process of a server (the HTTP server's and the engine's):
time, level, logger, the id of the request they concern ("-" for none), message; or as a logging configuration file
says (``apply_log_config``), in every process too. Light to import: the engine process imports it, not the server."""

from __future__ import annotations

import json
import logging
import logging.config
from datetime import UTC, datetime
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


class JsonLinesFormatter(logging.Formatter):
    """One JSON object a line, for ``--log-config`` (``{"()": "kiln.runtime.logs.JsonLinesFormatter"}``): ``time``
    (ISO 8601, UTC), ``level``, ``logger``, ``message``, ``process``, the request's ``request_id`` where a
    ``RequestIdFilter`` gave the record one, and a traceback as ``exception``, each escaped into the one line (a
    ``%``-template of JSON breaks on a quote in a message, as uvicorn's access lines hold)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                "level": record.levelname, "logger": record.name, "message": record.getMessage(),
                "process": record.process}
        if (request_id := getattr(record, "request_id", None)) is not None:
            line["request_id"] = request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


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


_applied_config: list[Path] = []  # the configuration file this process logs as (apply_log_config), for its children


def read_log_config(path: str | Path) -> dict:
    """A logging configuration file: a JSON object in ``logging.config.dictConfig``'s schema, as vLLM's
    ``VLLM_LOGGING_CONFIG_PATH`` names one. ValueError naming the file and what is wrong with it."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read the logging configuration {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the logging configuration {path} is not JSON: {exc}") from None
    if not isinstance(config, dict) or config.get("version") != 1:
        raise ValueError(f"the logging configuration {path} must be a JSON object of logging.config.dictConfig's "
                         f'schema, with "version": 1')
    return config


def apply_log_config(path: str | Path) -> None:
    """Log as the configuration file ``path`` says (``read_log_config``), and so do the processes this one starts
    (``child_logging``). Loggers made before it stay enabled unless it says ``"disable_existing_loggers": true``
    (vLLM's default configuration keeps them too), so that a configuration of the root logger alone still gets
    Kiln's and uvicorn's lines. ValueError naming the file where it cannot be read or applied (a handler class that
    does not import, a file it cannot open)."""
    config = {"disable_existing_loggers": False, **read_log_config(path)}
    try:
        logging.config.dictConfig(config)
    except (ValueError, TypeError, AttributeError, ImportError) as exc:
        raise ValueError(f"the logging configuration {path} cannot be applied: {exc}") from None
    _applied_config[:] = [Path(path).resolve()]


def applied_log_config() -> Path | None:
    """The logging configuration file this process logs as (``apply_log_config``), else None: the one the processes
    it starts apply too (``child_logging``)."""
    return _applied_config[0] if _applied_config else None


def child_logging() -> list[str]:
    """How this process logs, as arguments for a process it starts (``log_as_parent`` there): Kiln's log level,
    and the configuration file applied here ("" for none)."""
    return [str(logging.getLogger("kiln").level), str(applied_log_config() or "")]


def log_as_parent(level: int, config_path: str = "") -> None:
    """Log as the process that started this one: as its configuration file ``config_path`` says where it applied
    one, else from its ``level`` up on stderr, or, where it set none (NOTSET), with no handler added (an embedder's
    logging stays its own)."""
    if config_path:
        apply_log_config(config_path)
    elif level != logging.NOTSET:
        log_to_stderr(level)
