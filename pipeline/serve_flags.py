"""What ``kiln serve`` takes as vLLM takes it, checked before anything is built or loaded: the origins browsers may
call from, CORS wildcards, the API keys, the chat template, the tool-call parser and its numbers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from kiln.pipeline.vllm_names import VLLM_TOOL_CALL_PARSERS
from kiln.runtime.errors import KilnError
from kiln.runtime.server_defaults import DEFAULT_KEEP_ALIVE_S


def cors_origins(values: list[str]) -> tuple[str, ...]:
    """The origins --allowed-origins values name: each an origin ('*' or scheme://host[:port]) or, as vLLM takes
    the flag, a JSON list of them; '' names none. Each as a browser's Origin header spells it (``browser_origin``),
    which is what CORS matches exactly."""
    from kiln.runtime.server.cors import AllowedOriginsError, browser_origin

    origins = []
    for value in values:
        listed = [value] if not value.startswith("[") else _json_list(value)
        for origin in filter(None, listed):
            try:
                origins.append(browser_origin(origin))
            except AllowedOriginsError as exc:
                raise AllowedOriginsError(f"--allowed-origins {value}: {exc}") from None
    return tuple(origins)


def _json_list(value: str) -> list:
    """An --allowed-origins value in vLLM's form, a JSON list."""
    from kiln.runtime.server.cors import AllowedOriginsError

    try:
        listed = json.loads(value)
    except json.JSONDecodeError:
        listed = None
    if not isinstance(listed, list):
        raise AllowedOriginsError(f"--allowed-origins {value}: not a JSON list; give one origin, or a list such as "
                                  f"'[\"https://app.example\"]'")
    return listed


class CorsWildcardError(KilnError):
    """An --allowed-methods or --allowed-headers value other than vLLM's default, every one: all that Kiln allows."""


def check_cors_wildcards(methods: str | None, headers: str | None) -> None:
    """Take vLLM's --allowed-methods and --allowed-headers only as '["*"]' (their default) or '*': Kiln's CORS allows
    every method and request header, and would not honour a narrower list."""
    for flag, value, what in (("--allowed-methods", methods, "method"), ("--allowed-headers", headers, "header")):
        if value is not None and not _names_every_one(value):
            raise CorsWildcardError(f"{flag} {value}: Kiln's CORS allows every {what} and cannot narrow them; give "
                                    f"'[\"*\"]' (vLLM's default) or leave the flag out")


def _names_every_one(value: str) -> bool:
    """Whether a vLLM CORS list names every one: '*', or the JSON list ["*"]."""
    if value.strip() == "*":
        return True
    try:
        return json.loads(value) == ["*"]
    except json.JSONDecodeError:
        return False


class ChatTemplateFileError(KilnError):
    """A --chat-template file that cannot be read or does not parse."""


class BlankApiKeyError(KilnError):
    """An API key that is only whitespace: serving without one would not be what was asked."""


class KeepAliveError(KilnError):
    """A $VLLM_HTTP_TIMEOUT_KEEP_ALIVE that is not a number of seconds."""


def keep_alive_seconds(given: float | None, environ: Mapping[str, str]) -> float:
    """How long an idle connection stays open: --timeout-keep-alive, else vLLM's $VLLM_HTTP_TIMEOUT_KEEP_ALIVE (a
    deployment migrated from vLLM keeps its setting), else uvicorn's 5 s."""
    if given is not None:
        return given
    text = environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "").strip()
    if not text:
        return DEFAULT_KEEP_ALIVE_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise KeepAliveError(f"$VLLM_HTTP_TIMEOUT_KEEP_ALIVE={text!r}: not a number of seconds above 0; set one "
                             f"(above your load balancer's idle timeout), or unset it for {DEFAULT_KEEP_ALIVE_S:g}")
    return seconds


class BlankModelNameError(KilnError):
    """A --served-model-name that is empty or only whitespace: no client could name the model."""


def check_model_names(names: list[str] | None) -> None:
    """Refuse a blank --served-model-name (before any build)."""
    if names and not all(name.strip() for name in names):
        raise BlankModelNameError(f"--served-model-name {names!r}: a model id is blank; give the ids clients send, "
                                  f"or leave it out for the config's name")


def given_api_key(keys: list[str] | None, environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """The keys --api-key gives, else $KILN_API_KEY's; None when neither gives one (a blank one is refused)."""
    return _api_key(keys, "--api-key") if keys else _api_key(environ.get("KILN_API_KEY"), "$KILN_API_KEY")


def fallback_api_key(config_key: str | None, environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """Without --api-key or $KILN_API_KEY: the config's serve.api_key (a blank one is refused), else vLLM's
    $VLLM_API_KEY, which an empty or blank value leaves unset, as vLLM takes it (Helm charts often set it empty)."""
    if config_key is not None:
        return _api_key(config_key, "serve.api_key")
    vllm_key = environ.get("VLLM_API_KEY", "")
    return (vllm_key,) if vllm_key.strip() else None


def _api_key(keys: str | list[str] | None, where: str) -> tuple[str, ...] | None:
    """``keys`` (one, or several) as the server takes them; BlankApiKeyError naming ``where`` for a blank one."""
    if keys is None:
        return None
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    if not all(key.strip() for key in keys):
        raise BlankApiKeyError(f"{where}: the API key is blank; give the key clients must send, or none to serve "
                               f"without one")
    return keys


class ToolCallParserError(KilnError):
    """A --tool-call-parser naming a format Kiln would not read this engine's tool calls in."""


def check_tool_call_parser(parser: str | None, template: str | None, directory: Path | None) -> None:
    """Take vLLM's --tool-call-parser where it names the format Kiln reads tool calls in, the one the chat template
    teaches (``template``, else ``directory``'s: unknown while neither is given); refuse another, which Kiln would
    not honour."""
    if parser is None:
        return
    wanted = VLLM_TOOL_CALL_PARSERS.get(parser)
    if wanted is None:
        raise ToolCallParserError(f"--tool-call-parser {parser}: not a format Kiln parses (it takes "
                                  f"{', '.join(VLLM_TOOL_CALL_PARSERS)}, and reads the one the chat template "
                                  f"teaches); leave the flag out")
    if template is None and directory is None:
        return
    from kiln.runtime.chat_template import ChatTemplate
    from kiln.runtime.server.tool_calls import tool_call_format

    model_template = ChatTemplate.from_dir(directory) if template is None else None
    # the one a request with tools renders (a named tool_use template, Hermes-2-Pro's)
    source = template if template is not None else model_template and model_template.for_tools([]).source
    found = tool_call_format(source) if source else None
    if found is None:
        raise ToolCallParserError(f"--tool-call-parser {parser}: the chat template renders no tools, so Kiln "
                                  f"parses no tool calls; give a --chat-template that does, or leave the flag out")
    if found.name != wanted:
        raise ToolCallParserError(f"--tool-call-parser {parser}: the chat template teaches {found.name} tool calls, "
                                  f"which Kiln parses instead; give --tool-call-parser {found.name} or leave the "
                                  f"flag out")


def read_chat_template(value: str) -> str:
    """The source of a --chat-template: the file it names or, as vLLM takes it, the template itself where no file
    can be read and it reads as one ('{{' or '{%' in it); checked to parse as a Jinja template."""
    import jinja2

    from kiln.runtime.chat_template import ChatTemplate

    try:
        source, named = Path(value).read_text(encoding="utf-8"), value
    except (OSError, UnicodeDecodeError) as exc:
        if isinstance(exc, UnicodeDecodeError) or ("{{" not in value and "{%" not in value):
            raise ChatTemplateFileError(f"--chat-template {value}: cannot read it ({exc})") from None
        source, named = value, "(the template given inline)"
    try:
        ChatTemplate(source, {})
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateFileError(f"--chat-template {named}: not a valid Jinja template ({exc})") from None
    return source
