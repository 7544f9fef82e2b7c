"""How the server presents an engine: ``ServerSettings``, checked when made, so that a service embedding the server
hears of a bad setting at once rather than from every request."""

from __future__ import annotations

from dataclasses import dataclass, field

import jinja2

from kiln.runtime.chat_template import ChatTemplate
from kiln.runtime.sampling_defaults import GENERATION_CONFIG_MODES, GenerationConfigMode
from kiln.runtime.server.body_limit import DEFAULT_MAX_BODY_BYTES
from kiln.runtime.server.cors import browser_origins
from kiln.runtime.server.reasoning import REASONING_PARSERS
from kiln.runtime.server_defaults import DEFAULT_MAX_QUEUE


@dataclass
class ServerSettings:
    """How the server presents the engine: its model id (and aliases), API key, queue bound, body-size bound, chat
    template override, the reasoning parser, the origins browsers may call it from (CORS; none: no CORS headers) and
    whether they may send credentials, whether it serves its API's docs, and engine-cache facts."""

    model_name: str
    model_aliases: tuple[str, ...] = ()  # other ids requests may send (vLLM's further --served-model-name values)
    api_key: str | tuple[str, ...] | None = None  # or several (vLLM's --api-key k1 k2): clients send any one
    max_queue: int = DEFAULT_MAX_QUEUE
    chat_template: str | None = None  # a template's source that replaces the engine's own
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_origins: tuple[str, ...] = ("*",)  # vLLM's default; each taken as browsers send it (runtime/server/cors.py)
    allow_credentials: bool = False  # vLLM's --allow-credentials: CORS responses let browsers send credentials
    engine_cache: dict = field(default_factory=dict)  # {"hit": bool, "hit_rate": float, "key": str}, when known
    generation_config: GenerationConfigMode = "auto"  # the sampling defaults: the model's (vLLM's default) or vLLM's
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: qwen3 or deepseek_r1 (runtime/server/reasoning.py)
    fastapi_docs: bool = True  # /docs, /redoc and /openapi.json (off: vLLM's --disable-fastapi-docs)

    def __post_init__(self) -> None:
        if isinstance(self.model_aliases, str):  # one id, not its characters
            self.model_aliases = (self.model_aliases,)
        if isinstance(self.allowed_origins, str):
            self.allowed_origins = (self.allowed_origins,)
        for name in (self.model_name, *self.model_aliases):
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"model id {name!r} (model_name, model_aliases) must be a non-blank string: an id "
                                 f"clients send")
        if self.api_key is not None and not all(key.strip() for key in self.api_keys):
            raise ValueError("api_key is blank: give the key clients must send, or none to serve without one")
        for name in ("max_queue", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} must be a positive integer")
        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(f"generation_config {self.generation_config!r} is not one of "
                             f"{', '.join(GENERATION_CONFIG_MODES)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser {self.reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")
        if self.chat_template is not None:
            try:  # a name of one of the engine's templates, or one that names none, is told where the engine is
                ChatTemplate(self.chat_template, {})
            except jinja2.TemplateError as exc:
                raise ValueError(f"chat_template is not a valid Jinja template ({exc})") from None
        self.allowed_origins = browser_origins(self.allowed_origins)  # CORS matches a browser's Origin exactly

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys a client may send (none: no key is required)."""
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key or ())
