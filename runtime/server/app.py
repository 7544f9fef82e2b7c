"""The FastAPI app: OpenAI-compatible routes, /health, /metrics, API-key check, engine loading in the background."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, RedirectResponse, Response
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.runtime.errors import KilnError
from kiln.runtime.llm import LLM
from kiln.runtime.server.body_limit import BodyLimitMiddleware
from kiln.runtime.server.chat import create_chat_completion
from kiln.runtime.server.completions import create_completion
from kiln.runtime.server.draining import CloseWhileDrainingMiddleware
from kiln.runtime.server.errors import APIError, error_response, install_error_handlers
from kiln.runtime.server.generation import RETRY_AFTER_S, ServedModel
from kiln.runtime.server.jobs import check_model
from kiln.runtime.server.json_body import JSONBodyRoute
from kiln.runtime.server.metrics import RequestCountMiddleware, ServerMetrics
from kiln.runtime.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from kiln.runtime.server.request_id import REQUEST_ID_HEADER, RequestIdMiddleware
from kiln.runtime.server.responding import IGNORED_FIELDS_HEADER, ignored_header
from kiln.runtime.server.responses import create_response
from kiln.runtime.server.responses_protocol import ResponseObject, ResponsesRequest
from kiln.runtime.server.route_path import route_path
from kiln.runtime.server.settings import ServerSettings
from kiln.runtime.server.tokenize import detokenize, server_version, tokenize, tokenizer_info

logger = logging.getLogger("kiln.server")

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 503)}
_STREAMING = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                    "description": "JSON, or server-sent events ending in `data: [DONE]` when `stream` is true"}}


class ServerState:
    """What the routes share: the served model once loaded, a load error, and whether the server is draining."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings  # the HTTP protocol's too: it drains an answered body up to a bound past theirs
        self.model: ServedModel | None = None
        self.load_error: BaseException | None = None
        self.load_abandoned = False  # stopped while loading: the load thread may still run (inside torch)
        self.draining = False
        self.lifespan_started = False  # a mounted app's lifespan runs only where its parent's runs it
        self.on_fatal: Callable[[], None] | None = None  # set by the runner: stop serving (the load failed)
        self.created = int(time.time())

    def busy(self) -> bool:
        """Whether generation requests are still in flight."""
        return self.model is not None and self.model.admission.outstanding > 0

    def engine_stats(self) -> dict | None:
        """The engine's statistics while it serves; None while it loads or once it has failed (none of its figures
        would be current)."""
        if self.model is None or self.model.llm.engine_error is not None:
            return None
        return self.model.llm.stats()

    def never_loaded(self) -> str | None:
        """Why the engine will never load: the app was given a loader, which its lifespan calls, and that lifespan did
        not run (Starlette runs none for a mounted app); None otherwise."""
        if self.model is not None or self.lifespan_started:
            return None
        return ("the engine is never loaded: the lifespan of the app create_app made, which calls its loader, did not "
                "run (Starlette runs none for a mounted app); run it in your app's, "
                "FastAPI(lifespan=kiln_app.router.lifespan_context), or pass create_app an LLM you loaded")

    def require_model(self) -> ServedModel:
        if self.draining:
            raise APIError(503, "the server is shutting down: retry against another replica",
                           headers={"Retry-After": str(RETRY_AFTER_S)}, refusal="draining")
        if (never_loaded := self.never_loaded()) is not None:
            raise APIError(503, never_loaded, refusal="load_failed")
        if self.model is None:
            message = (f"the engine failed to load: {self.load_error}" if self.load_error
                       else f"the engine is still loading: retry after {RETRY_AFTER_S} s")
            raise APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)},
                           refusal="load_failed" if self.load_error else "loading")
        return self.model


_KEYED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info", "/invocations")


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on /v1/ routes, /invocations, /tokenize, /detokenize and
    /tokenizer_info; /health, /ping, /metrics and /version stay open for probes."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.expected = [key.strip().encode() for key in api_keys]  # a key read from a file may end in a newline

    def _accepts(self, key: bytes) -> bool:
        """Whether ``key`` is one of the expected keys, compared with each in constant time."""
        return any([hmac.compare_digest(key, expected) for expected in self.expected])  # a list: every one compared

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""  # mounted in an embedder's app too
        if path.startswith("/v1/") or path in _KEYED_PATHS:
            header = dict(scope["headers"]).get(b"authorization")
            scheme, _, key = (header or b"").partition(b" ")
            if header is None or scheme.lower() != b"bearer" or not self._accepts(key.strip()):
                message = ("Missing API key: send it as 'Authorization: Bearer <key>'" if header is None else
                           "Incorrect API key provided: send the key the server was started with")
                error = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(llm: LLM | Callable[[], LLM], engine_dir: str | Path, settings: ServerSettings) -> FastAPI:
    """The server over `llm`: an `LLM` the caller owns (ready at once), or a loader the app calls in the background
    at startup (/health answers 503 until it returns) and whose `LLM` it closes at shutdown."""
    if not isinstance(settings, ServerSettings):
        raise TypeError(f"settings must be a ServerSettings, got {type(settings).__name__}: "
                        f"create_app(llm, engine_dir, ServerSettings(model_name=...))")
    if not isinstance(llm, LLM) and not callable(llm):
        raise TypeError(f"llm must be an LLM or a function that loads one, got {type(llm).__name__}: "
                        f"create_app(LLM.load(engine_dir), ...) or create_app(lambda: LLM.load(engine_dir), ...)")
    state = ServerState(settings)
    no_docs = {} if settings.fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Kiln", version="1", lifespan=_lifespan(state, llm, Path(engine_dir), settings),
                  description="OpenAI-compatible completions and chat completions over a Kiln engine.", **no_docs)
    app.state.server = state
    metrics = ServerMetrics(state.engine_stats, lambda: settings.engine_cache,
                            lambda: state.model.llm.engine_pid if state.model else None, settings.model_name,
                            worker_pids=lambda: state.model.llm.worker_pids if state.model else {})
    install_error_handlers(app)
    app.router.route_class = JSONBodyRoute  # bodies parsed within bounds on their shape, large ones off the loop
    _add_middleware(app, state, settings, metrics)
    _add_routes(app, state, settings, metrics)
    return app


def _lifespan(state: ServerState, llm: LLM | Callable[[], LLM], engine_dir: Path,
              settings: ServerSettings) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the model attached at once (an `LLM`) or loaded in the background (a loader), whose
    `LLM` it then closes at shutdown."""
    def attach(loaded: LLM) -> None:
        state.model = ServedModel(loaded, settings.model_name, engine_dir, settings.max_queue,
                                  settings.chat_template, settings.generation_config, settings.model_aliases,
                                  settings.reasoning_parser)

    async def load() -> None:
        try:
            loaded = await _in_daemon_thread(llm)
            attach(loaded)
        except Exception as exc:
            state.load_error = exc
            logger.error("the engine failed to load: %s", exc,
                         exc_info=None if isinstance(exc, KilnError) else exc)  # a traceback where it is a bug
            if state.on_fatal is not None:
                state.on_fatal()
            return
        logger.info("engine loaded in %.1f s: serving %s", loaded.load_ms / 1000, settings.model_name)

    if isinstance(llm, LLM):  # ready at once, lifespan or not: an app mounted in the embedder's app gets none
        attach(llm)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.lifespan_started = True
        loading = None if isinstance(llm, LLM) else asyncio.create_task(load())
        yield
        if loading is None:  # the embedder's LLM: it closes it
            return
        if not loading.done():  # stopped while loading: the load is abandoned, not waited for (it may never end)
            logger.warning("stopped while the engine loads: the load is abandoned")
            state.load_abandoned = True
            loading.cancel()
        elif state.model is not None:
            await asyncio.to_thread(state.model.llm.close)

    return lifespan


def _in_daemon_thread(load: Callable[[], LLM]) -> asyncio.Future:
    """``load()`` on a daemon thread, so that a process stopping while it runs does not wait for it (an engine
    process it started dies with that thread); an LLM it returns once nobody waits is closed."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(outcome: LLM | BaseException) -> None:
        if future.done():  # abandoned: no one will serve it
            if isinstance(outcome, LLM):
                threading.Thread(target=outcome.close, daemon=True).start()
        elif isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def run() -> None:
        try:
            outcome: LLM | BaseException = load()
        except BaseException as exc:  # handed to the waiter
            outcome = exc
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop has closed: nobody waits
            if isinstance(outcome, LLM):
                outcome.close()

    threading.Thread(target=run, name="kiln-load", daemon=True).start()
    return future


def _add_middleware(app: FastAPI, state: ServerState, settings: ServerSettings, metrics: ServerMetrics) -> None:
    """Body limit, API key, request counts, request ids, closing connections while draining and CORS, innermost
    first."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=settings.api_keys)
    app.add_middleware(RequestCountMiddleware, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(CloseWhileDrainingMiddleware, draining=lambda: state.draining)
    if settings.allowed_origins:  # outermost: a preflight needs no key, and a 401 still carries the CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=settings.allow_credentials,
                           expose_headers=[REQUEST_ID_HEADER.decode(), IGNORED_FIELDS_HEADER])


def invocation(body: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
    """An /invocations body as the request it is: a chat completion (`messages`) or a completion (`prompt`), checked
    as those routes check it (a 400 naming the field)."""
    kind = ChatCompletionRequest if "messages" in body else CompletionRequest if "prompt" in body else None
    if kind is None:
        raise APIError(400, "an /invocations body needs 'messages' (a chat completion) or 'prompt' (a completion): "
                            "send one of them")
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def _add_routes(app: FastAPI, state: ServerState, settings: ServerSettings, metrics: ServerMetrics) -> None:
    """Health, metrics, the OpenAI routes and vLLM's tokenizer and version routes."""

    async def require_model() -> ServedModel:  # async: a plain function would cost each request a thread hop
        return state.require_model()

    served = Depends(require_model)

    async def health() -> JSONResponse:
        """200 once the engine is loaded and the server takes requests; 503 before, while draining, or on error."""
        engine_error = state.model.llm.engine_error if state.model is not None else None
        if state.model is not None and state.model.llm.closed and engine_error is None and not state.draining:
            engine_error = "the LLM was closed (by the service that passed it in): load one again"
        if state.model is not None and not state.draining and engine_error is None:
            return JSONResponse({"status": "ok", "model": settings.model_name})
        error = state.load_error or engine_error or state.never_loaded()
        status = "error" if error else "draining" if state.draining else "loading"
        body = {"status": status, **({"message": str(error)} if error else {})}
        return JSONResponse(body, status_code=503)

    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus text exposition (gzipped where the scraper accepts that; only the samples ?name[]= names)."""
        payload, headers = metrics.exposition(request.headers.get("accept-encoding", ""),
                                              request.query_params.getlist("name[]"))
        return Response(payload, headers=headers)

    # HEAD too, which load balancers' health checks send (HAProxy's httpchk): a route a method, so that each
    # operation of the OpenAPI schema has an id of its own (client generators refuse repeated ones)
    for path, endpoint, methods, responses in (
            ("/health", health, ("GET", "HEAD"), {503: {"description": "loading, draining, or the load failed"}}),
            ("/ping", health, ("GET", "HEAD", "POST"), {503: {"description": "as /health (vLLM's SageMaker route)"}}),
            ("/metrics", prometheus_metrics, ("GET", "HEAD"), None)):
        for method in methods:
            app.add_api_route(path, endpoint, methods=[method], responses=responses,
                              operation_id=f"{path.strip('/')}_{method.lower()}")

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models(model: ServedModel = served) -> ModelList:
        return ModelList(data=[model.card(state.created, name) for name in model.names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def retrieve_model(model_id: str, request: Request, model: ServedModel = served) -> ModelCard | Response:
        if not model_id:  # "/v1/models/": to the list, as any other route's trailing slash is redirected
            return RedirectResponse(request.url.replace(path=request.url.path.rstrip("/")), status_code=307)
        check_model(model, model_id)
        return model.card(state.created, model_id)

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_ERRORS, **_STREAMING})
    async def completions(body: CompletionRequest, request: Request) -> object:
        return await create_completion(state.require_model(), body, metrics, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_ERRORS, **_STREAMING})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> object:
        return await create_chat_completion(state.require_model(), body, metrics, request)

    @app.post("/v1/responses", response_model=ResponseObject, responses={**_ERRORS, **_STREAMING})
    async def responses(body: ResponsesRequest, request: Request) -> object:
        """OpenAI's Responses API, stateless: the whole conversation comes as input."""
        return await create_response(state.require_model(), body, metrics, request)

    @app.post("/invocations", response_model=ChatCompletionResponse | CompletionResponse,
              responses={**_ERRORS, **_STREAMING})
    async def invocations(body: Annotated[dict[str, Any], Body()], request: Request) -> object:
        """SageMaker's route (as vLLM serves it): a body with `messages` is a chat completion, with `prompt` a
        completion."""
        req = invocation(body)
        create = create_chat_completion if isinstance(req, ChatCompletionRequest) else create_completion
        return await create(state.require_model(), req, metrics, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize_route(body: TokenizeRequest, response: Response) -> TokenizeResponse:
        """Token ids of a prompt, or of chat messages through the chat template (vLLM's endpoint)."""
        tokens, unread = await asyncio.to_thread(tokenize, state.require_model(), body)  # long texts: off the loop
        if unread:
            response.headers[IGNORED_FIELDS_HEADER] = ignored_header(unread)
        return tokens

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids (vLLM's endpoint)."""
        return await asyncio.to_thread(detokenize, state.require_model(), body)

    @app.get("/tokenizer_info", responses=_ERRORS)
    async def tokenizer_info_route() -> dict:
        """The tokenizer's configuration and chat template (vLLM's endpoint, which lm-evaluation-harness reads)."""
        return tokenizer_info(state.require_model())

    @app.get("/version", response_model=VersionResponse)
    async def version_route() -> VersionResponse:
        return server_version()
