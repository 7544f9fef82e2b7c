"""OpenAI-style error bodies (`{"error": {"message", "type", "param", "code"}}`) for every failure the server sends."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from kiln.runtime.server.foreign_fields import foreign_field_advice
from kiln.runtime.server.utf8_json import Utf8JSONResponse

logger = logging.getLogger("kiln.server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error"}
OVERLOADED = "server_overloaded"  # the type of a 503 for a server at capacity (others: loading, draining, stopped)
# why a 503 turned a request away before any work (kiln_requests_refused_total's reasons); set in the ASGI scope
REFUSAL_REASONS = ("capacity", "draining", "loading", "load_failed", "engine_stopped")
REFUSAL = "kiln.refusal"


class APIError(Exception):
    """A request the server refuses; becomes an OpenAI-style error response."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, kind: str | None = None, refusal: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.kind = kind  # the body's "type", where the status alone does not say it
        self.refusal = refusal  # one of REFUSAL_REASONS: a request turned away for the server's state, not its own


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None,
               kind: str | None = None) -> dict:
    kind = kind or _TYPES.get(status_code, "invalid_request_error" if 400 <= status_code < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return Utf8JSONResponse(error_body(error.status_code, error.message, error.param, error.code, error.kind),
                            status_code=error.status_code, headers=error.headers)


def describe_validation_error(exc: RequestValidationError, route: str | None = None) -> APIError:
    """The first problem of a request body as a 400 that names the field (`messages[0].role`); where a field takes
    a text or a list and got a list, the list's deepest problem, which names the item at fault (`input[1].name`), and
    where it takes a name or an object and got an object, the object's (`tool_choice.function.name`).
    An unknown field that another server (SGLang) takes gets what to send instead on ``route`` (the route's path)."""
    errors = exc.errors()
    error = errors[0]
    if (error.get("type") == "string_type" and isinstance(error.get("input"), list)
            or error.get("type") == "literal_error" and isinstance(error.get("input"), dict)):
        error = max(errors, key=lambda found: len(found.get("loc", ())))
    kind = error.get("type", "")
    raw = [part for part in error.get("loc", ()) if part != "body"]
    loc = [part for part in raw if not _union_member(part)]
    if kind == "extra_forbidden" and raw and raw[-1] not in loc:  # the unknown field, whatever its name ("a[b")
        loc.append(raw[-1])
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    if kind == "json_invalid":
        detail = error.get("ctx", {}).get("error", "JSON decode error")
        where = f" at character {loc[-1]}" if loc else ""
        return APIError(400, f"request body is not valid JSON ({detail}{where}): send a JSON object")
    if not loc:
        body = error.get("input")
        if kind == "missing":
            return APIError(400, "request body is missing: send a JSON object with the request's fields")
        if isinstance(body, bytes):  # not decoded: sent without the JSON content type
            return APIError(400, "request body must be JSON sent with 'Content-Type: application/json'")
        return APIError(400, f"request body must be a JSON object, not {type(body).__name__}")
    if kind == "extra_forbidden":
        message, advice = f"Unrecognized request argument supplied: {param}", foreign_field_advice(param, route)
        return APIError(400, f"{message}; {advice}" if advice else message, param=param)
    if kind == "missing":
        return APIError(400, f"'{param}' is a required property", param=param)
    message = error.get("msg", "is invalid").removeprefix("Value error, ")
    return APIError(400, f"Invalid value for '{param}': {message[0].lower()}{message[1:]}", param=param)


def _union_member(part: str | int) -> bool:
    """Whether a part of pydantic's error location names the member of a union that was tried
    (``literal['none','auto']``, ``NamedToolChoice``, ``str``) rather than a field: clients see field paths only."""
    return isinstance(part, str) and (not part.isidentifier() or part[:1].isupper() or part in _SCALAR_TYPES)


_SCALAR_TYPES = {"str", "int", "float", "bool"}  # the names pydantic gives a union's plain members


def served_routes(app: FastAPI) -> str:
    """The routes an app serves, as "GET /v1/models, POST /v1/completions, ..." (its OpenAPI ones)."""
    return ", ".join(f"{method} {route.path_format}" for route in _schema_routes(app)
                     for method in sorted(route.methods))


def served_paths(app: FastAPI) -> str:
    """The paths an app serves, once each, as "/health, /v1/completions, ..." (its OpenAPI ones)."""
    return ", ".join(dict.fromkeys(route.path_format for route in _schema_routes(app)))


def _schema_routes(app: FastAPI) -> list[APIRoute]:
    return [route for route in app.routes if isinstance(route, APIRoute) and route.include_in_schema]


def install_error_handlers(app: FastAPI) -> None:
    """Every error response, including FastAPI's own (422, 404, 405) and bugs (500), gets the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.refusal is not None:  # counted by the request counter
            request.scope[REFUSAL] = exc.refusal
        if exc.status_code >= 500 and exc.__context__ is not None:  # a failure behind it (the engine's), not a refusal
            logger.error("%s %s: %d %s", request.method, request.url.path, exc.status_code, exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        route = getattr(request.scope.get("route"), "path", None)  # the matched route's, whatever the mount
        return error_response(describe_validation_error(exc, route))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and exc.detail == "Not Found":  # no such route (an unknown model has its own 404)
            message = (f"{request.method} {request.url.path} is not served here; the routes are "
                       f"{served_routes(request.app)}")
        return Utf8JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                                headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return Utf8JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}"), status_code=500)
