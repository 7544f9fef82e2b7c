"""Embed Kiln's runtime in your own Python service: an async web app and a background worker share one engine.

    python examples/embedded_service.py ENGINE_DIR              # serve on 127.0.0.1:8080 until Ctrl-C
    python examples/embedded_service.py ENGINE_DIR --self-test  # run a few calls of each kind, exit

One `LLM` is loaded per process. Its engine thread batches every caller's requests together (in-flight
batching), whether they come from asyncio handlers (`generate_async`, `stream`) or from plain threads
(`generate`, `submit`/`result`). Needs the serve extra for FastAPI and uvicorn, and httpx for --self-test's calls;
the runtime itself needs neither.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import threading
from concurrent.futures import Future

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from kiln.runtime import LLM, InvalidRequestError, SamplingParams
from kiln.runtime.server import with_cancellation


class Worker:
    """A thread that drains a job queue in batches with the blocking API: `llm.generate` on up to 8 prompts."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.jobs: queue.Queue[tuple[str, Future] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="summary-worker", daemon=True)
        self.thread.start()

    def submit(self, text: str) -> Future:
        future: Future = Future()
        self.jobs.put((text, future))
        return future

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    def _run(self) -> None:
        params = SamplingParams(temperature=0, max_tokens=16)
        while (job := self.jobs.get()) is not None:
            batch = [job]
            while len(batch) < 8 and not self.jobs.empty() and (job := self.jobs.get()) is not None:
                batch.append(job)
            # A job whose caller gave up (asyncio.wait_for's timeout, a cancelled handler) is skipped; one taken here
            # can no longer be cancelled, so setting its result below cannot fail.
            self._serve([(f"Summary of: {text}\n", future) for text, future in batch
                         if future.set_running_or_notify_cancel()], params)
            if job is None:
                break

    def _serve(self, batch: list[tuple[str, Future]], params: SamplingParams) -> None:
        """Run one batch. A prompt the engine refuses (too long, say) fails its own job; an engine that stops fails
        the batch; either way the worker goes on to the next."""
        runnable = []
        for prompt, future in batch:
            try:
                self.llm.check(prompt, params)
                runnable.append((prompt, future))
            except InvalidRequestError as e:
                future.set_exception(e)
        if not runnable:
            return
        try:
            outputs = self.llm.generate([prompt for prompt, _ in runnable], params)
        except Exception as e:  # the engine closed or failed: every job waiting on this batch hears why
            for _, future in runnable:
                future.set_exception(e)
            return
        for (_, future), out in zip(runnable, outputs, strict=True):
            future.set_result(out.text)


class Ask(BaseModel):
    question: str
    max_tokens: int = 32


def make_app(llm: LLM, worker: Worker) -> FastAPI:
    """Your service's own routes; every one of them reaches the same engine."""
    app = FastAPI(title="an app that embeds Kiln")

    @app.exception_handler(InvalidRequestError)  # a prompt too long for the engine, say: the client's to fix
    async def invalid_request(_: object, error: InvalidRequestError) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=400)

    @app.post("/ask")
    @with_cancellation  # Starlette would run the handler to its end after the client left: this cancels it
    async def ask(body: Ask, request: Request) -> dict:
        # Awaiting does not block the event loop; a cancelled handler aborts its request.
        out = await llm.generate_async(body.question, SamplingParams(temperature=0, max_tokens=body.max_tokens))
        return {"answer": out.text, "tokens": len(out.token_ids), "ttft_s": out.metrics.time_to_first_token}

    @app.post("/ask/stream")
    async def ask_stream(body: Ask) -> StreamingResponse:
        async def text():
            # Leaving this loop early (the client went away) closes the stream, which aborts the request.
            async for delta in llm.stream(body.question, SamplingParams(temperature=0, max_tokens=body.max_tokens)):
                yield delta.text

        return StreamingResponse(text(), media_type="text/plain")

    @app.post("/summarize")
    async def summarize(body: Ask) -> dict:
        # Hand the job to the thread-based worker and await its future without blocking the loop.
        return {"summary": await asyncio.wrap_future(worker.submit(body.question))}

    @app.get("/engine")
    async def engine() -> dict:
        stats = llm.stats()
        return {"load_ms": stats["load_ms"], "kv_cache": stats["kv_cache"], "running": stats["num_running"]}

    return app


def self_test(app: FastAPI, worker: Worker) -> None:
    """Start the app on a free loopback port, call each route alongside direct worker jobs, print, stop."""
    import httpx

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    direct = [worker.submit(f"direct job {i}") for i in range(3)]

    async def calls() -> list:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(
                client.post("/ask", json={"question": "Once upon a time", "max_tokens": 8}),
                client.post("/ask/stream", json={"question": "Monday, Tuesday,", "max_tokens": 8}),
                client.post("/summarize", json={"question": "the runtime batches every caller"}),
                client.get("/engine"))

    for response in asyncio.run(calls()):
        response.raise_for_status()
        print(response.request.url.path, "->", response.text[:120])
    too_long = httpx.post(f"{url}/summarize", json={"question": "word " * 100_000}, timeout=120)
    print("/summarize of a text too long ->", too_long.status_code)  # 400, and the worker goes on serving:
    for future in [*direct, worker.submit("a job after that one")]:
        print("worker ->", repr(future.result(timeout=120)))
    server.should_exit = True
    thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", help="an engine directory (the one `kiln build` printed)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--self-test", action="store_true", help="call every route once, print, and exit")
    args = parser.parse_args()

    with LLM.load(args.engine) as llm:  # one engine for the whole process; closed on the way out
        worker = Worker(llm)
        app = make_app(llm, worker)
        try:
            if args.self_test:
                self_test(app, worker)
            else:
                uvicorn.run(app, host="127.0.0.1", port=args.port)
        finally:
            worker.close()


if __name__ == "__main__":
    main()
