"""The OpenAI-compatible HTTP server over `runtime.LLM` (needs the serve extra: fastapi, uvicorn, prometheus-client,
jinja2). `import runtime` never imports it."""

# what the server imports beyond the runtime (pydantic is missing only after `pip install --no-deps kiln`)
_SERVE_EXTRA_MODULES = frozenset({"fastapi", "starlette", "uvicorn", "prometheus_client", "jinja2", "pydantic"})

try:
    from kiln.runtime.server.app import create_app
    from kiln.runtime.server.disconnect import with_cancellation
    from kiln.runtime.server.serve import EngineFailedError, ServerStartError, ServerThread, run_server
    from kiln.runtime.server.settings import ServerSettings
except ModuleNotFoundError as exc:
    if (exc.name or "").split(".")[0] not in _SERVE_EXTRA_MODULES:
        raise
    from kiln.runtime.version import SERVE_EXTRA_INSTALL

    raise ModuleNotFoundError(f"kiln.runtime.server needs the serve extra ({exc.name} is missing): "
                              f"{SERVE_EXTRA_INSTALL}", name=exc.name) from None

__all__ = ["EngineFailedError", "ServerSettings", "ServerStartError", "ServerThread", "create_app", "run_server",
           "with_cancellation"]
