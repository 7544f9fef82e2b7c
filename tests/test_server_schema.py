"""schemathesis against the server's own OpenAPI schema, valid and invalid inputs alike: no response is a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from kiln.runtime import LLM
from kiln.runtime.server import ServerSettings, ServerThread, create_app
from tests.test_server_support import engine_idle, tiny_engine, wait_until

# A short context and a small queue keep each generated request cheap: at most 31 tokens, at most 20 sequences.
SHORT_CONTEXT = 32
EXAMPLES_PER_OPERATION = 30
WITH_BODY = {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /invocations",
             "POST /tokenize", "POST /detokenize"}


@pytest.fixture(scope="module")
def llm():
    with LLM.load(tiny_engine(max_seq_len=SHORT_CONTEXT)) as llm:
        yield llm


@pytest.fixture(scope="module")
def api_schema(llm):
    app = create_app(llm, tiny_engine(max_seq_len=SHORT_CONTEXT), ServerSettings(model_name="tiny", max_queue=4))
    with ServerThread(app) as server:
        yield schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


def test_schema_covers_every_route(api_schema):
    assert {op.label for op in operations(api_schema)} == {
        "GET /health", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_id}", "POST /v1/completions",
        "POST /v1/chat/completions", "POST /v1/responses", "POST /tokenize", "POST /detokenize", "GET /version",
        "GET /ping", "POST /ping", "GET /tokenizer_info", "POST /invocations",
        "HEAD /health", "HEAD /ping", "HEAD /metrics"}  # load balancers' checks


def test_every_operation_has_an_id_of_its_own(api_schema):  # client generators refuse a repeated one
    ids = [op.definition.raw["operationId"] for op in operations(api_schema)]
    assert len(ids) == len(set(ids)), sorted(ids)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_makes_the_server_fail(api_schema, llm, mode):
    for operation in operations(api_schema):
        if mode is GenerationMode.NEGATIVE and operation.label not in WITH_BODY:
            continue

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case) -> None:
            response = case.call(timeout=60)
            assert response.status_code < 500, (f"{case.method} {case.path} {case.body!r} -> "
                                                f"{response.status_code}: {response.text[:300]}")

        call()
    wait_until(lambda: engine_idle(llm))
