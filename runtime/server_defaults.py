"""What a served engine gets unless told otherwise, in one place: ``ServerSettings``, the config's ``serve``
section and ``kiln serve`` take their defaults from here. Plain values, so the config schema reads them without
importing the server (``kiln.runtime.server`` imports fastapi and uvicorn)."""

DEFAULT_HOST = "127.0.0.1"  # loopback: other interfaces only when told
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 256  # requests that may wait beyond the engine's batch before new ones get 503
DEFAULT_KEEP_ALIVE_S = 5.0  # an idle connection's life: uvicorn's, and vLLM's unless $VLLM_HTTP_TIMEOUT_KEEP_ALIVE
