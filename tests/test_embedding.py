"""Embedding the runtime in a service: a route whose client leaves aborts its request, the server leaves the
embedder's log handlers alone, a cancelled request's id is free at once, a mounted app whose lifespan never ran says
so, and a closed LLM refuses `with`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx
import pytest
from fastapi import FastAPI, Request  # at module level: FastAPI reads a route's string annotations in its globals

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.errors import EngineClosedError, InvalidRequestError, KilnError
from kiln.runtime.server import ServerSettings, ServerStartError, ServerThread, create_app, with_cancellation
from tests.test_server_support import engine_idle, tiny_engine, wait_until

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture()
def slow_llm():
    """The tiny engine at 50 ms a step: a 200-token request takes 10 s."""
    with LLM.load(tiny_engine()) as llm:
        step = llm.engine.step
        llm.engine.step = lambda: (time.sleep(0.05), step())[1]
        yield llm


def test_a_route_with_cancellation_aborts_its_request_once_the_client_leaves(slow_llm):
    mine = FastAPI()
    mine.mount("/kiln", create_app(slow_llm, tiny_engine(), ServerSettings(model_name="tiny")))

    @mine.post("/ask")
    @with_cancellation
    async def ask(question: str, request: Request) -> dict:
        return {"answer": (await slow_llm.generate_async(question, LONG)).text}

    with ServerThread(mine) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/ask", params={"question": "Once upon a time"}, timeout=0.5)
        started = time.monotonic()
        wait_until(lambda: engine_idle(slow_llm) and slow_llm.stats()["requests_finished"]["abort"] == 1, 5)
        assert time.monotonic() - started < 5  # not the 10 s of its 200 tokens


def test_a_server_thread_leaves_the_embedders_log_handlers_open(llm, tmp_path):
    from kiln.runtime.logs import LOG_FORMAT

    root, mine = logging.getLogger(), logging.FileHandler(tmp_path / "service.log", mode="w")
    root.addHandler(mine)
    try:
        with ServerThread(create_app(llm, tiny_engine(), ServerSettings(model_name="tiny"))):
            logging.getLogger("service").warning("while serving")
        logging.getLogger("service").warning("after serving")
        assert mine.stream is not None and not mine.stream.closed
    finally:
        root.removeHandler(mine)
        mine.close()
    lines = (tmp_path / "service.log").read_text().splitlines()
    assert "while serving" in lines and "after serving" in lines
    assert [handler.formatter._fmt for handler in logging.getLogger("uvicorn").handlers] == [LOG_FORMAT]


def test_a_cancelled_requests_id_is_free_as_soon_as_the_cancellation_is_back(slow_llm):
    async def scenario() -> tuple[str, str]:
        first = asyncio.create_task(slow_llm.generate_async("Once upon a time", LONG, request_id="r1"))
        await asyncio.sleep(0.3)  # running in the engine
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        again = await slow_llm.generate_async("Once upon a time", SamplingParams(max_tokens=3), request_id="r1")
        async with contextlib.aclosing(slow_llm.stream_many(["Hello"], LONG, request_ids=["r2"])) as stream:
            await anext(stream)
        streamed = await slow_llm.generate_async("Hello", SamplingParams(max_tokens=2), request_id="r2")
        return again.finish_reason, streamed.finish_reason

    assert asyncio.run(scenario()) == ("length", "length")  # their own outputs, not the aborted requests'
    wait_until(lambda: engine_idle(slow_llm))
    assert slow_llm.stats()["requests_finished"]["abort"] == 2


def test_a_request_id_in_use_is_an_invalid_request_error(llm):
    request_id = llm.submit("Hello", SamplingParams(max_tokens=2), request_id="taken")
    with pytest.raises(InvalidRequestError, match="request id 'taken' is already in use") as refused:
        llm.submit("Hello", SamplingParams(max_tokens=2), request_id="taken")
    assert isinstance(refused.value, KilnError) and isinstance(refused.value, ValueError)
    llm.result(request_id)


def test_a_mounted_loaders_app_whose_lifespan_never_runs_says_so():
    from fastapi.testclient import TestClient

    def unmounted() -> FastAPI:
        mine = FastAPI()
        mine.mount("/kiln", create_app(lambda: LLM.load(tiny_engine()), tiny_engine(),
                                       ServerSettings(model_name="tiny")))
        return mine

    with pytest.raises(ServerStartError, match=r"lifespan .* did not run .*FastAPI\(lifespan=kiln_app"):
        ServerThread(unmounted()).start()
    with TestClient(unmounted(), base_url="http://testserver/kiln") as http:
        health = http.get("/health")
        assert health.status_code == 503 and "did not run" in health.json()["message"]
        refused = http.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
        assert refused.status_code == 503 and "retry" not in refused.json()["error"]["message"]


def test_entering_a_closed_llm_raises_as_its_calls_do():
    llm = LLM.load(tiny_engine())
    llm.close()
    with pytest.raises(EngineClosedError, match="the LLM is closed"), llm:
        pass
