"""The child side: load an engine, then step it for as long as it has work, sending every step's results (and the
engine's stats every ``STATS_INTERVAL_S``) to the parent; it lives as long as the parent's end of the pipe."""

from __future__ import annotations

import importlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path

from kiln.runtime.engine import Engine, load_engine
from kiln.runtime.engine_process.lifetime import leave_stop_signals_to_parent, outlive_parent_thread
from kiln.runtime.engine_process.wire import error_to_wire, receive, request_from_wire, result_to_wire, send
from kiln.runtime.errors import KilnError
from kiln.runtime.heap import freeze_startup_heap
from kiln.runtime.logs import log_as_parent
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.outputs import RequestFailure, StreamDelta

logger = logging.getLogger("kiln.runtime")

STATS_INTERVAL_S = 0.2
FAILURE_POLL_S = 0.25  # how often an idle engine process asks its engine whether it failed


def load(engine_dir: str, options: dict) -> Engine:
    """The default factory: the engine of ``engine_dir``, loaded in this process with ``options``."""
    return load_engine(Path(engine_dir), RuntimeOptions(**options))


def main(fd: int, log_level: int = logging.NOTSET, log_config: str = "") -> int:
    """Serve the parent on the socket ``fd``: read the factory, load, say hello (or why the load failed), run. Logs
    as the parent does: as its configuration file ``log_config`` says, else Kiln's lines on stderr from ``log_level``
    up (NOTSET: it set none, nor is one set here)."""
    log_as_parent(log_level, log_config)
    leave_stop_signals_to_parent()  # the parent closes this process through the pipe once it has drained
    conn = Connection(fd)
    try:
        spec = receive(conn)
        module, _, function = spec["factory"].partition(":")
        try:
            engine = getattr(importlib.import_module(module), function)(**spec["arguments"])
        except Exception as exc:
            send(conn, {"error": error_to_wire(exc)})
            return 1
        outlive_parent_thread()
        freeze_startup_heap()
        tokenizer = engine.tokenizer.to_dict() if engine.tokenizer is not None else None
        send(conn, {"limits": asdict(engine.limits), "tokenizer": tokenizer, "stats": engine.stats_snapshot(),
                    "worker_pids": list(getattr(engine, "worker_pids", {}).items())})  # JSON keys would be strings
        try:
            serve(conn, engine)
        except Exception as exc:  # a bug in the engine: the parent fails what is in flight and reports it
            send(conn, {"fatal": error_to_wire(exc)})
            logger.critical("the engine stopped: %s: %s", type(exc).__name__, exc, exc_info=exc)
            return 1
        finally:
            engine.close()
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the parent has gone: nobody is left to serve
        return 0
    return 0


class Inbox:
    """The parent's messages, read on a thread of their own as they come: the parent never waits to send a command
    (a large one: a long prompt, a big logit_bias) while this process waits to send it results, each with its pipe
    full (a deadlock of both)."""

    def __init__(self, conn: Connection) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(conn,), name="kiln-engine-inbox", daemon=True).start()

    def _read(self, conn: Connection) -> None:
        try:
            while True:
                self._queue.put(receive(conn))
        except Exception as exc:  # the parent has gone (EOFError), or a message did not decode: the loop raises it
            self._queue.put(exc)

    def get(self, timeout: float) -> dict | None:
        """The next message, waiting up to ``timeout`` seconds (None when none came); raises what ended the reads."""
        try:
            message = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(message, Exception):
            raise message
        return message


def serve(conn: Connection, engine: Engine) -> None:
    """Apply the parent's adds and aborts between steps; after each step (or a command that produced a result), send
    what it gave. While idle, do the engine's deferred warm-up one piece at a time and say when it is done. Returns
    when the parent says close."""
    inbox = Inbox(conn)
    last_stats = 0.0
    warming = True
    while True:
        results: list[StreamDelta | RequestFailure] = []
        for message in _messages(inbox, not (engine.has_unfinished() or warming), engine):
            if "close" in message:
                return
            if "add" in message:  # the requests the parent took since its last message, all before the next step
                for wire in message["add"]:
                    seq = request_from_wire(wire)
                    try:
                        engine.add_request(seq)
                    except KilnError as exc:
                        results.append(RequestFailure(seq.request_id, exc))
            elif (delta := engine.abort_request(message["abort"])) is not None:
                results.append(delta)
        stepped = engine.has_unfinished()
        if stepped:
            results += engine.step()
        warmed = False
        if warming and not stepped:
            warming = engine.warm_up_step()
            warmed = not warming
        if not (results or stepped or warmed):
            continue
        reply: dict = {"results": [result_to_wire(result) for result in results]}
        if warmed:
            reply["warm"] = True
        now = time.monotonic()
        if idle := not engine.has_unfinished():
            reply["idle"] = True
        if now - last_stats >= STATS_INTERVAL_S or idle:
            reply["stats"], last_stats = engine.stats_snapshot(), now
        send(conn, reply)


def _messages(inbox: Inbox, block: bool, engine: Engine) -> Iterator[dict]:
    """The parent's waiting messages (waiting for the first when ``block``, and raising ``engine.failure()`` if the
    engine fails meanwhile: a tensor-parallel worker that exits while the engine is idle stops this process, whose
    exit the parent notices)."""
    if block:
        while (message := inbox.get(FAILURE_POLL_S)) is None:
            if (failure := engine.failure()) is not None:
                raise failure
        yield message
    while (message := inbox.get(0)) is not None:
        yield message
