"""What to send instead of the request fields SGLang names differently, or another OpenAI route names: the advice that
the "Unrecognized request argument" 400 of a generation route adds for them, so a client moved from SGLang (or a
request built for another route) learns Kiln's name, or that there is none, from the error."""

from __future__ import annotations

RESPONSES_ROUTE = "/v1/responses"
# completions and chat completions (and SageMaker's /invocations, which takes either body) share these fields
CHAT_AND_COMPLETIONS_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})

# SGLang's top-level name, or another route's -> what completions and chat completions take instead (only a field
# the route refuses gets its advice: chat takes max_completion_tokens, completions does not)
FOREIGN_FIELDS: dict[str, str] = {
    "max_output_tokens": "send max_tokens instead (the Responses API's name)",
    "max_completion_tokens": "send max_tokens instead (max_completion_tokens is chat's name for it)",
    "regex": 'send structured_outputs: {"regex": ...} instead',
    "json_schema": 'send response_format: {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} or '
                   'structured_outputs: {"json": {...}} instead',
    "ebnf": 'send structured_outputs: {"grammar": ...} instead (GBNF, as SGLang\'s ebnf, or a Lark grammar)',
    "no_stop_trim": "send include_stop_str_in_output: true instead",
    "rid": "send request_id instead (or an X-Request-Id header)",
    "separate_reasoning": "reasoning is separated by the server: start it with kiln serve --reasoning-parser",
    "max_new_tokens": "send max_tokens instead",
    "min_new_tokens": "send min_tokens instead",
    "stop_regex": "stopping at a regex is not supported: stop takes strings",
    "sampling_seed": "send seed instead",
    "lora_path": "LoRA adapters are not supported",
    "return_hidden_states": "returning hidden states is not supported",
}
# the same for the Responses API, where some of these have other names or none
RESPONSES_FOREIGN_FIELDS: dict[str, str] = {
    **{name: advice for name, advice in FOREIGN_FIELDS.items() if name != "max_output_tokens"},  # its own field
    "json_schema": 'send text: {"format": {"type": "json_schema", "name": ..., "schema": {...}}} or '
                   'structured_outputs: {"json": {...}} instead',
    "no_stop_trim": "keeping the stop string is not supported on /v1/responses (chat and completions take "
                    "include_stop_str_in_output: true)",
    "max_new_tokens": "send max_output_tokens instead",
    "max_tokens": "send max_output_tokens instead",
    "max_completion_tokens": "send max_output_tokens instead",
    "response_format": 'send text: {"format": {...}} instead',
}


def foreign_field_advice(param: str, route: str | None) -> str | None:
    """What to send instead of ``param`` (a top-level field the request model refused) on ``route`` (the route's
    path), or None where it is no known foreign name or the route no generation route."""
    if route == RESPONSES_ROUTE:
        return RESPONSES_FOREIGN_FIELDS.get(param)
    return FOREIGN_FIELDS.get(param) if route in CHAT_AND_COMPLETIONS_ROUTES else None
