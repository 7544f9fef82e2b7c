"""What every generation route does to a request before it runs: the checks that need the served model, the format
it asks for compiled, and its jobs."""

from __future__ import annotations

import asyncio
import logging

from kiln.runtime.limits import outside_vocabulary
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.generation import Job, ServedModel, sampling_params
from kiln.runtime.server.protocol import SamplingFields
from kiln.runtime.server.responding import HEADER_SAFE_NAME
from kiln.runtime.structured_output import StructuredOutput, StructuredOutputError

logger = logging.getLogger("kiln.server")
# the unknown keys of chat messages (their tool calls' and content parts' too: messages[].content[].cache_control)
# and of Responses input items (input[].status, input[].content[].cache_control) warned of once per server, up to
# this many in all: their names are the client's to choose (the request fields a server ignores are a fixed few,
# each always warned of once)
MAX_LOGGED_MESSAGE_KEYS = 256
MESSAGE_KEY_PREFIXES = ("messages[].", "input[].")
# what stands in logged_ignored_fields for a name too long or of characters too odd to log (not HEADER_SAFE_NAME):
# its hash, so that the name is neither kept nor written
_UNSHOWN = "(unshown) "


def log_ignored_fields(model: ServedModel, names: list[str]) -> None:
    """Warn of each of ``names`` (what a request set that changes nothing) the first time a request sets it: every
    request field, and messages' and input items' keys (MESSAGE_KEY_PREFIXES) up to MAX_LOGGED_MESSAGE_KEYS, those
    that are no HEADER_SAFE_NAME counted in one warning, not named."""
    stand_ins = {name if HEADER_SAFE_NAME.fullmatch(name) else f"{_UNSHOWN}{hash(name):x}" for name in names}
    new = sorted(stand_ins - model.logged_ignored_fields)
    client_chosen = (*MESSAGE_KEY_PREFIXES, _UNSHOWN)
    keys = sum(logged.startswith(client_chosen) for logged in model.logged_ignored_fields) if new else 0
    unshown = 0
    for name in new:
        if name.startswith(client_chosen):
            if keys >= MAX_LOGGED_MESSAGE_KEYS:
                continue
            keys += 1
        model.logged_ignored_fields.add(name)
        if name.startswith(_UNSHOWN):
            unshown += 1
        else:
            logger.warning("requests set %r, which this server accepts and ignores (logged once)", name)
    if unshown:
        logger.warning("requests set %d other unknown keys whose names are not shown (too long or odd characters), "
                       "which this server accepts and ignores (logged once)", unshown)


def make_jobs(model: ServedModel, req: SamplingFields, prompts: list[list[int]], max_tokens: list[int], *,
              logprobs: int | None, prompt_logprobs: int | None, structured_output: StructuredOutput | None,
              max_tokens_param: str = "max_tokens") -> list[Job]:
    """`n` jobs per prompt, in OpenAI's choice order (prompt-major), with the model's sampling defaults (the request's
    ignored fields logged); ``max_tokens_param``: the field the client set the length with, which errors name."""
    log_ignored_fields(model, req.ignored_fields())
    try:
        return [Job(ids, sampling_params(req, max_tokens=limit, index=choice, logprobs=logprobs,
                                         prompt_logprobs=prompt_logprobs, structured_output=structured_output,
                                         defaults=model.sampling_defaults))
                for ids, limit in zip(prompts, max_tokens, strict=True) for choice in range(req.n)]
    except ValueError as exc:  # a combination the fields' own checks cannot see (min_tokens above max_tokens)
        message = str(exc).removeprefix("SamplingParams.").replace("max_tokens=", f"{max_tokens_param}=")
        field = message.split(" ", 1)[0]
        raise APIError(400, message, param=field if field in type(req).model_fields else None) from None


def computed_prompt_logprobs(req: SamplingFields) -> int | None:
    """The request's ``prompt_logprobs``, none when it streams: no chunk carries them, so a streamed 0 (which vLLM
    takes) computes nothing and keeps the prefix cache."""
    return None if req.stream else req.prompt_logprobs


def format_field(req: SamplingFields) -> str:
    """The field that asks for the request's output format, as its errors name it: ``response_format`` unless it is
    absent or plain text, else ``structured_outputs`` (vLLM's extension, or its guided_* fields)."""
    requested = req.response_format
    return "response_format" if requested is not None and requested.type != "text" else "structured_outputs"


async def compiled_format(req: SamplingFields) -> StructuredOutput | None:
    """``requested_format``, compiled off the event loop (it may take a while) where the request asks for a format:
    one that asks for none takes no worker thread, which other requests' long tokenizations may all hold."""
    asks = ((req.response_format is not None and req.response_format.type != "text")
            or req.structured_outputs is not None or req.guided_outputs() is not None)
    return await asyncio.to_thread(requested_format, req) if asks else None


def requested_format(req: SamplingFields) -> StructuredOutput | None:
    """The format ``response_format`` (OpenAI) or ``structured_outputs`` (vLLM's extension, or its guided_* fields)
    asks for, compiled."""
    requested, extension = req.response_format, req.structured_outputs
    extension_name = "structured_outputs"
    if (guided := req.guided_outputs()) is not None:
        if extension is not None:
            raise APIError(400, "send structured_outputs or the guided_* fields (its names before vLLM 0.11), not "
                                "both", param="structured_outputs")
        extension, extension_name = guided, "the guided_* fields"
    if requested is not None and requested.type == "text":
        requested = None
    if requested is not None and extension is not None:
        raise APIError(400, f"send response_format or {extension_name}, not both", param="structured_outputs")
    param = format_field(req)
    try:
        if extension is not None:
            spec = StructuredOutput(json=extension.json_schema, json_object=bool(extension.json_object),
                                    regex=extension.regex, grammar=extension.grammar, choice=extension.choice)
        elif requested is None:
            return None
        elif requested.type == "json_object":
            spec = StructuredOutput(json_object=True)
        elif requested.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs its json_schema: a name, and the schema "
                                "to hold the output to (without one, any JSON)", param="response_format.json_schema")
        elif requested.json_schema.json_schema is None:
            spec = StructuredOutput(json_object=True)
        else:
            spec = StructuredOutput(json=requested.json_schema.json_schema)
        _ = spec.llguidance_grammar
    except StructuredOutputError as exc:
        raise APIError(400, str(exc), param=param) from None
    return spec


def check_model(model: ServedModel, requested: str | None) -> None:
    """A 404 unless ``requested`` is unset or one of the model's names."""
    if requested is not None and requested not in model.names:
        raise APIError(404, f"The model '{requested}' does not exist: this server serves "
                            f"{', '.join(repr(name) for name in model.names)} "
                            f"(see /v1/models)", param="model", code="model_not_found")


def check_request(model: ServedModel, req: SamplingFields) -> None:
    """``check_model``, then a 400 naming the field for ``n`` over the sequences the server holds at once, for
    ``stream_options`` without ``stream`` (as OpenAI and vLLM refuse it) or for a token id outside the vocabulary in
    ``logit_bias``, ``stop_token_ids`` or ``allowed_token_ids``."""
    check_model(model, req.model)
    model.admission.check_fits(req.n, "n")  # n alone: completions counts its prompts too, naming "prompt"
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true: drop it or stream the response",
                       param="stream_options")
    if req.stream and req.prompt_logprobs:  # no chunk carries them: vLLM refuses 1 and up (0: computed_prompt_logprobs)
        raise APIError(400, "prompt_logprobs are not available with stream: true: drop one of them",
                       param="prompt_logprobs")
    vocab_size = model.limits.vocab_size
    for param, token_ids in (("logit_bias", req.logit_bias or {}), ("stop_token_ids", req.stop_token_ids or []),
                             ("allowed_token_ids", req.allowed_token_ids or [])):
        if vocab_size is not None and len(token_ids) > vocab_size:  # each of its prompts' choices would copy them
            raise APIError(400, f"'{param}' names {len(token_ids)} token ids, more than this model's vocabulary of "
                                f"{vocab_size} tokens: name each once", param=param)
        if outside := outside_vocabulary(token_ids, vocab_size):
            raise APIError(400, f"'{param}' names token ids {outside[:8]} outside this model's vocabulary of "
                                f"{vocab_size} tokens: send ids below {vocab_size}", param=param)

