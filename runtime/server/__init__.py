"""The OpenAI-compatible HTTP server over `runtime.LLM` (needs the serve extra: fastapi, uvicorn, prometheus-client,
jinja2). `import runtime` never imports it."""

from kiln.runtime.server.app import ServerSettings, create_app
from kiln.runtime.server.serve import EngineFailedError, ServerStartError, ServerThread, run_server

__all__ = ["EngineFailedError", "ServerSettings", "ServerStartError", "ServerThread", "create_app", "run_server"]
