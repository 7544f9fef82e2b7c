"""Run the app under uvicorn: in a background thread (tests, embedding, load tests) or in the foreground until
SIGTERM/SIGINT, which stop accepting, let in-flight requests finish within a bounded time, and return normally."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI
from starlette.routing import Host, Mount

from kiln.runtime import logs
from kiln.runtime.errors import EngineClosedError, KilnError
from kiln.runtime.server.app import ServerState
from kiln.runtime.server.http_protocol import BODY_TIMEOUT_S, HEAD_TIMEOUT_S, http_protocol_options
from kiln.runtime.server.request_id import RequestIdFilter
from kiln.runtime.server_defaults import DEFAULT_KEEP_ALIVE_S

logger = logging.getLogger("kiln.server")

DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0  # within Kubernetes' default grace period (30 s), with time to spare
DRAIN_POLL_S = 0.05
ABORT_FLUSH_S = 2.0  # how long aborted requests get to write their error once the drain time is up
CLOSE_FLUSH_S = 0.5  # the least uvicorn gets, once the port closes, to send responses the drain just ended


class ServerStartError(KilnError):
    """The server could not start (an address it cannot listen on, the engine failed to load)."""


class UnknownHostError(ServerStartError):
    """A host to listen on that does not resolve to an address."""


class EngineFailedError(KilnError):
    """The engine stopped while serving (its process died, a device error); the server drained and stopped, so that
    what supervises it (systemd, Kubernetes, a restart policy) starts it again, as vLLM's server does."""

    exit_code = 1


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (IPv6 for a host with a colon, as uvicorn binds); ServerStartError naming
    why not: a host that does not resolve (UnknownHostError), a port in use, a privileged port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][4]
    except socket.gaierror as exc:
        raise UnknownHostError(f"cannot serve on host {host!r}: {exc.strerror}; give an address of this machine "
                               f"(127.0.0.1, 0.0.0.0, ::) or a name that resolves to one") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = "; is another server on that port? choose another with --port" if exc.errno == errno.EADDRINUSE else ""
        raise ServerStartError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sock


def stderr_log_handler() -> logging.Handler:
    """Log lines on stderr as Kiln writes them (``logs.LOG_FORMAT``), with the id of the request being served."""
    handler = logs.stderr_log_handler()
    handler.addFilter(RequestIdFilter())
    return handler


def log_uvicorn_in_kiln_format() -> None:
    """Send uvicorn's lines (its access log too) through ``stderr_log_handler``, so that a server's log has one
    format; their level is uvicorn's ``log_level``. Only uvicorn's loggers are set: a dictConfig would close every
    handler of the process (an embedder's log file among them)."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers = [stderr_log_handler()] if name == "uvicorn" else []
        uvicorn_logger.propagate = name != "uvicorn"  # up to "uvicorn"'s handler, and no further


def served_state(app: FastAPI) -> ServerState:
    """The state of the Kiln app that ``app`` is, or mounts (``your_app.mount("/kiln", create_app(...))``, at any
    depth): what draining and the engine's health are read from. TypeError for an app with none or several."""
    found, apps = [], [app]
    while apps:
        current = apps.pop()
        if isinstance(state := getattr(getattr(current, "state", None), "server", None), ServerState):
            found.append(state)
        apps.extend(route.app for route in getattr(current, "routes", ()) if isinstance(route, Mount | Host))
    if len(found) != 1:
        raise TypeError(f"{'no app create_app made is' if not found else f'{len(found)} apps create_app made are'} "
                        f"served or mounted in this {type(app).__name__} app: serve one (mounted in yours, or on its "
                        f"own); a server drains and watches one engine")
    return found[0]


class ServerThread:
    """uvicorn serving `app` on `host:port` (port 0: any free one) in a daemon thread, until `stop()`, logging from
    ``log_level`` up in Kiln's format (``kiln_log_format`` False: uvicorn's loggers left as the process configured
    them); with ``access_log`` a line per request. A request's line and headers are
    bounded (``http_protocol``): due within ``head_timeout_s``, and its body's chunks within ``body_timeout_s`` of
    each other; an idle connection is closed after ``keep_alive_s``."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *,
                 shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S, log_level: str = "warning",
                 access_log: bool = False, head_timeout_s: float = HEAD_TIMEOUT_S,
                 body_timeout_s: float = BODY_TIMEOUT_S, keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
                 kiln_log_format: bool = True) -> None:
        self.app = app
        self.state = served_state(app)
        if kiln_log_format:
            log_uvicorn_in_kiln_format()
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level if kiln_log_format else None,
                                log_config=None, lifespan="on", timeout_graceful_shutdown=shutdown_timeout_s,
                                access_log=access_log, timeout_keep_alive=keep_alive_s,
                                **http_protocol_options(head_timeout_s, body_timeout_s,
                                                        self.state.settings.max_body_bytes))
        self.server = uvicorn.Server(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self._deadline = 0.0  # when a graceful shutdown must be over: set by the first stop_accepting
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=lambda: self.server.run(sockets=self._sockets), name="kiln-http",
                                        daemon=True)
        self.state.on_fatal = self.stop_accepting

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = self.server.config.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def start(self) -> ServerThread:
        """Start serving and return once the socket listens (the engine may still be loading); ServerStartError
        when it cannot listen on its host and port, or when the Kiln app's lifespan did not run (mounted in an app
        whose own lifespan does not run it), so that its engine would never load."""
        self._sockets.append(listening_socket(self.server.config.host, self.server.config.port))
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise ServerStartError(f"the server did not start on {self.server.config.host}:"
                                       f"{self.server.config.port} (see the log above)")
            self._thread.join(0.02)
        if (never_loaded := self.state.never_loaded()) is not None:
            self._close()
            self.wait()
            raise ServerStartError(never_loaded)
        return self

    def stop_accepting(self) -> None:
        """Begin a graceful shutdown: the port stays open while in-flight requests finish (within the shutdown
        timeout), /health answering 503 "draining" and new requests 503, so load balancers see the server leave;
        then the server closes. A second call closes at once (in-flight requests keep what is left of the
        timeout)."""
        state = self.state
        if state.draining:
            self._close()
            return
        state.draining = True
        self._deadline = time.monotonic() + self.shutdown_timeout_s
        in_flight = state.model.admission.outstanding if state.model is not None else 0
        logger.info("draining: %d sequence%s in flight, up to %g s to finish", in_flight, "" if in_flight == 1 else "s",
                    self.shutdown_timeout_s)
        threading.Thread(target=self._exit_when_idle, name="kiln-drain", daemon=True).start()

    def _exit_when_idle(self) -> None:
        state = self.state
        while time.monotonic() < self._deadline and state.busy():
            time.sleep(DRAIN_POLL_S)
        if state.busy() and state.model is not None:
            # out of time: end what is left with an error its clients can read (an SSE error event and [DONE], or
            # a JSON error), rather than let uvicorn cancel the handlers mid-write
            state.model.llm.abort_all(EngineClosedError(
                f"the server shut down before this request finished (its shutdown timeout, "
                f"{self.shutdown_timeout_s:g} s, ran out): retry against another replica"))
            flushed = time.monotonic() + ABORT_FLUSH_S
            while time.monotonic() < flushed and state.busy():
                time.sleep(DRAIN_POLL_S)
        self._close()

    def _close(self) -> None:
        """Close the port. A request whose body is still arriving is answered 503 at once (``http_protocol``);
        connections whose response is not complete (a stream its client stopped reading) get what is left of the
        shutdown timeout, at least CLOSE_FLUSH_S, then uvicorn cancels them: its grace period does not start the
        timeout over."""
        self.server.config.timeout_graceful_shutdown = max(CLOSE_FLUSH_S, self._deadline - time.monotonic())
        self.server.should_exit = True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the server thread to end; True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Shut down gracefully and wait."""
        self.stop_accepting()
        self.wait()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def run_server(app: FastAPI, host: str, port: int, *, shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
               on_started: Callable[[ServerThread], None] | None = None, access_log: bool = False,
               log_level: str = "info", keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
               kiln_log_format: bool = True) -> None:
    """Serve in the foreground until SIGTERM or SIGINT, then drain and return (a SIGINT once the port has closed
    forces the exit). Signals are handled when called from the main thread; elsewhere, stop it with the
    `ServerThread` given to `on_started`. ``log_level`` is uvicorn's; ``keep_alive_s``: how long an idle connection
    is kept open (above a load balancer's idle timeout, so that it never reuses one the server is closing);
    ``kiln_log_format`` False leaves uvicorn's loggers as the process configured them (a logging configuration file).

    Raises ServerStartError when the server cannot start or the engine fails to load, EngineFailedError after a
    drain when the engine stopped while serving, and KeyboardInterrupt when the exit was forced."""
    thread = ServerThread(app, host, port, shutdown_timeout_s=shutdown_timeout_s, log_level=log_level,
                          access_log=access_log, keep_alive_s=keep_alive_s, kiln_log_format=kiln_log_format)

    def on_signal(signum: int, _: FrameType | None) -> None:
        if thread.server.should_exit and signum == signal.SIGINT:
            thread.server.force_exit = True
        thread.stop_accepting()

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)} if in_main_thread else {}
    state = thread.state
    engine_error = None
    try:
        thread.start()
        if on_started is not None:
            on_started(thread)
        while not thread.wait(0.25):  # wake regularly so the main thread can take SIGTERM / SIGINT
            if engine_error is None and state.model is not None and state.model.llm.engine_error is not None:
                engine_error = state.model.llm.engine_error
                logger.error("the engine stopped: %s; the server stops too", engine_error)
                thread.stop_accepting()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if thread.server.force_exit:  # in-flight requests were cut off, not drained: exit 130, not 0
        raise KeyboardInterrupt
    if state.load_error is not None:
        raise ServerStartError(f"the engine failed to load: {state.load_error}") from state.load_error
    if engine_error is not None:
        raise EngineFailedError(f"the engine stopped while serving ({engine_error}): the server stopped with it; "
                                f"start it again (a supervisor's restart policy does)")
