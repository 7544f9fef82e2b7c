"""The three ways ``kiln loadtest`` runs a workload, measured alike: streaming HTTP clients against a server,
asyncio clients streaming from the embedded ``LLM`` in this process (no HTTP), and the engine offline (the requests
through ``LLM.generate_async``, as many in flight as the clients keep, each finished one replaced at once).
Comparing them says where serving loses time: HTTP and the server, or the stream path between the engine and its
callers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kiln.pipeline.bench.serving_workload import ServingRequest, ServingWorkload
from kiln.runtime.errors import KilnError
from kiln.runtime.stats import summarize

# what a streamed chat delta carries that is output: its answer, its reasoning (vLLM's ``reasoning``, and
# ``reasoning_content`` before it), or its tool calls, as vLLM's serving benchmark counts reasoning as output
DELTA_OUTPUT = ("content", "reasoning", "reasoning_content", "tool_calls")
# how long a run waits for a server still loading its engine (503 "loading"), as vLLM's bench serve waits for one
READY_WAIT_S = 600.0


class LoadTestError(KilnError):
    """The server could not be reached, or answered none of the requests."""


@dataclass
class RequestResult:
    """One streamed request as its client saw it (seconds on the client's monotonic clock): ``events`` is how many
    pieces of the output arrived (a piece may carry several tokens); ``disconnected``: the client went away
    mid-stream, as its request said to."""

    status: int
    ttft_s: float | None = None
    latency_s: float | None = None
    completion_tokens: int = 0
    events: int = 0
    gaps_s: list[float] = field(default_factory=list)
    error: str | None = None
    disconnected: bool = False
    without_usage: bool = False  # the server sent no usage: its tokens are estimated (``estimate_tokens``)
    finish_reason: str | None = None

    def arrived(self, start: float, last: float | None) -> float:
        """Note one piece of output arriving now; returns the time of it."""
        now = time.monotonic()
        if last is None:
            self.ttft_s = now - start
        else:
            self.gaps_s.append(now - last)
        self.events += 1
        return now


async def drive(workload: ServingWorkload, concurrency: int, send: Callable[[ServingRequest], Awaitable[RequestResult]],
                ready: Callable[[], Awaitable[float]] | None = None) -> tuple[list[RequestResult], float]:
    """Run the warm-up requests, then the measured ones at their arrival times with at most ``concurrency`` in
    flight; returns the measured results and the seconds from the first arrival to the last completion. ``ready``,
    awaited after the warm-up, says when the measurement starts (on this process's monotonic clock): at once
    without it."""
    gate = asyncio.Semaphore(concurrency)

    async def one(request: ServingRequest, at: float, origin: float) -> RequestResult:
        await asyncio.sleep(max(0.0, origin + at - time.monotonic()))
        async with gate:
            return await send(request)

    warm = time.monotonic()
    await asyncio.gather(*(one(r, 0.0, warm) for r in workload.warmup))
    start = await ready() if ready is not None else time.monotonic()
    results = await asyncio.gather(*(one(r, at, start) for r, at in zip(workload.requests, workload.arrivals_s,
                                                                        strict=True)))
    return list(results), time.monotonic() - start


async def run_http(url: str, workload: ServingWorkload, *, concurrency: int, chat: bool = False,
                   api_key: str | None = None, model: str | None = None, timeout_s: float = 600.0) -> dict:
    """The workload as streaming requests to an OpenAI-compatible server at ``url``; the report (latencies in ms).

    The clients are aiohttp's, whose C parsers cost about a fifth of httpx's CPU per streamed event: a load test's
    clients must not be what limits the server they measure."""
    results, duration, model = await http_results(url, workload, concurrency=concurrency, chat=chat, api_key=api_key,
                                                  model=model, timeout_s=timeout_s)
    return summarize_results(results, duration, url=url, model=model, clients=concurrency, chat=chat)


async def http_results(url: str, workload: ServingWorkload, *, concurrency: int, chat: bool, api_key: str | None,
                       model: str | None, timeout_s: float = 600.0,
                       ready: Callable[[], Awaitable[float]] | None = None,
                       ) -> tuple[list[RequestResult], float, str]:
    """``run_http``'s results one by one, the measurement's seconds and the model; ``ready`` as ``drive`` takes it."""
    aiohttp = _aiohttp()
    if chat and workload.uses_token_ids:
        raise LoadTestError("--chat sends messages, which are text: random token prompts (--input-len) go to "
                            "/v1/completions; leave out --chat")
    async with _session(url, api_key, concurrency, timeout_s) as session:
        model = model or (await _model_card(session, url))["id"]
        path = "/v1/chat/completions" if chat else "/v1/completions"

        async def send(request: ServingRequest) -> RequestResult:
            try:
                return await _one_http_request(session, path, _payload(model, request, chat),
                                               request.disconnect_after)
            except (TimeoutError, aiohttp.ClientError) as exc:
                return RequestResult(status=0, error=f"{type(exc).__name__}: {exc}")

        results, duration = await drive(workload, concurrency, send, ready)
    return results, duration, model


async def fetch_model_card(url: str, api_key: str | None, on_wait: Callable[[str], None] | None = None) -> dict:
    """The first model the server at ``url`` lists (Kiln's card also has the engine's ``vocab_size`` and
    ``max_model_len``); ``on_wait`` is told once when the server is waited for."""
    async with _session(url, api_key, 1, 60.0) as session:
        return await _model_card(session, url, on_wait=on_wait)


async def count_prompt_tokens(url: str, api_key: str | None, model: str, prompts: set[str],
                              chat: bool) -> dict[str, int]:
    """The tokens of each text prompt as the server counts them: one ``POST /tokenize`` per prompt (vLLM's and
    Kiln's route; as a user message where ``chat``, its chat template included). A prompt the server did not count
    (no such route, an error) is left out."""
    aiohttp = _aiohttp()

    async def count(session, prompt: str) -> int | None:
        body = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        try:
            async with session.post("/tokenize", json={"model": model, **body}) as response:
                return int((await response.json())["count"]) if response.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, KeyError, TypeError, ValueError):
            return None

    async with _session(url, api_key, 8, 60.0) as session:
        counts = await asyncio.gather(*(count(session, prompt) for prompt in prompts))
    return {prompt: n for prompt, n in zip(prompts, counts, strict=True) if n is not None}


def _aiohttp():
    try:
        import aiohttp
    except ImportError:
        from kiln.runtime.version import SERVE_EXTRA_INSTALL

        raise LoadTestError(f"kiln loadtest's HTTP clients need aiohttp, of the serve extra: "
                            f"{SERVE_EXTRA_INSTALL}") from None
    return aiohttp


def _session(url: str, api_key: str | None, concurrency: int, timeout_s: float):
    aiohttp = _aiohttp()
    return aiohttp.ClientSession(url.rstrip("/"), connector=aiohttp.TCPConnector(limit=concurrency),
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                                 timeout=aiohttp.ClientTimeout(total=timeout_s), read_bufsize=2**20)


async def _model_card(session, url: str, ready_wait_s: float = READY_WAIT_S,
                      on_wait: Callable[[str], None] | None = None) -> dict:
    """The served model's card; a server still loading its engine, or not listening yet (`kiln serve &` building
    it first), is waited for (up to ``ready_wait_s``, as vLLM's bench serve waits), ``on_wait`` told once."""
    aiohttp = _aiohttp()
    deadline = time.monotonic() + ready_wait_s
    told = False
    try:
        while True:
            try:
                async with session.get("/v1/models") as response:
                    loading = response.status == 503 and "loading" in await response.text()
                    if not loading or time.monotonic() >= deadline:
                        response.raise_for_status()
                        return (await response.json())["data"][0]
                    retry_after, why = float(response.headers.get("Retry-After", 1)), "its engine is loading"
            except aiohttp.ClientConnectorError:  # refused: nothing listens there yet
                if time.monotonic() >= deadline:
                    raise
                retry_after, why = 1.0, "nothing answers there yet"
            if on_wait is not None and not told:
                told = True
                on_wait(f"waiting for {url} ({why}), up to {ready_wait_s / 60:g} minutes")
            await asyncio.sleep(retry_after)  # with the connection given back
    except (TimeoutError, aiohttp.ClientError, KeyError, IndexError, ValueError) as exc:
        why = "no answer in time" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        raise LoadTestError(f"{url}: cannot list models ({why}): is the server up and the key right?") from None


def _payload(model: str, request: ServingRequest, chat: bool) -> dict:
    body = {"model": model, "max_tokens": request.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}
    if chat:
        return {**body, "messages": [{"role": "user", "content": request.prompt}]}
    return {**body, "prompt": request.prompt}


def error_message(body: bytes) -> str:
    """What a failed response says: its OpenAI error's message, else the start of its body."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]


async def _one_http_request(session, path: str, payload: dict, disconnect_after: int | None) -> RequestResult:
    start = time.monotonic()
    result, last, done = RequestResult(status=0), None, False
    async with session.post(path, json=payload) as response:
        result.status = response.status
        if response.status != 200:
            result.error = error_message(await response.read())
            return result
        async for line in response.content:
            done = done or line.startswith(b"data: [DONE]")
            if not line.startswith(b"data: {"):
                continue
            if (choice := _read_chunk(line[6:], result)) is None:
                continue
            result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if _carries_output(choice):
                last = result.arrived(start, last)
                if result.events == disconnect_after:
                    result.disconnected = True
                    response.close()  # drops the connection: the server sees the client go
                    break
    if not (result.disconnected or result.error):  # every request ignores EOS: it ends by length, then [DONE]
        result.error = _unfinished(result.finish_reason, done)
    if not (result.completion_tokens or result.disconnected or result.error) and result.events:
        result.completion_tokens, result.without_usage = estimate_tokens(result, payload["max_tokens"]), True
    result.latency_s = time.monotonic() - start
    return result


def time_per_output_token(result: RequestResult) -> float | None:
    """vLLM's TPOT: the seconds after the first token over the tokens after it (None for a request of one token),
    which a chunk of several tokens or a separate finish chunk does not skew as it does the inter-token gaps."""
    if result.ttft_s is None or result.latency_s is None or result.completion_tokens < 2:
        return None
    return (result.latency_s - result.ttft_s) / (result.completion_tokens - 1)


def estimate_tokens(result: RequestResult, max_tokens: int) -> int:
    """The tokens of a stream whose server sent no usage: ``max_tokens`` where it ended by length (every request
    ignores EOS), else one token a chunk (a server that stopped early anyway: counting max_tokens overstated it)."""
    return max_tokens if result.finish_reason == "length" else result.events


def _unfinished(finish_reason: str | None, done: bool) -> str | None:
    """Why a stream that closed without an error did not finish: it ended before a finish_reason, or before
    OpenAI's closing ``data: [DONE]``; None for a stream that finished."""
    if finish_reason is None:
        return "the stream ended before a finish_reason"
    return None if done else "the stream ended without data: [DONE]"


def _read_chunk(data: bytes, result: RequestResult) -> dict | None:
    """A stream chunk's first choice (``{}`` when it has none), its usage counted in ``result``; None for an error
    event (OpenAI's ``{"error": {"message"}}``, or TGI's ``{"error": "..."}``) or a chunk that is no OpenAI chunk,
    which fails the request, not the load test."""
    try:
        chunk = json.loads(data)
    except ValueError:
        chunk = None
    if not isinstance(chunk, dict):
        result.error = f"a stream chunk that is no JSON object: {data[:80].decode(errors='replace')!r}"
        return None
    if "error" in chunk:
        error = chunk["error"]
        result.error = str(error.get("message") if isinstance(error, dict) else error)
        return None
    usage = chunk.get("usage")  # on the last chunk, or on every one (vLLM's continuous_usage_stats)
    if isinstance(usage, dict) and type(tokens := usage.get("completion_tokens")) is int:
        result.completion_tokens = tokens
    choices = chunk.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    if not isinstance(choice, dict):
        result.error = f"a stream chunk whose choice is no object: {data[:80].decode(errors='replace')!r}"
        return None
    return choice


def _carries_output(choice: dict) -> bool:
    """Whether a stream chunk's choice brings generated output: text, a chat delta's answer, reasoning or tool
    calls (``DELTA_OUTPUT``), or the finish (a chat stream's first chunk only names the role)."""
    delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
    return bool(choice.get("text") or any(delta.get(name) for name in DELTA_OUTPUT) or choice.get("finish_reason"))


async def run_in_process(llm, workload: ServingWorkload, *, concurrency: int) -> dict:
    """The workload as asyncio clients streaming from ``llm`` in this process (no HTTP, no server)."""

    async def send(request: ServingRequest) -> RequestResult:
        start = time.monotonic()
        result, last = RequestResult(status=200), None
        try:
            async with contextlib.aclosing(llm.stream(request.prompt, _params(request))) as stream:
                async for delta in stream:
                    result.completion_tokens += len(delta.token_ids)
                    if delta.text or delta.finished:  # what an HTTP client sees: text held back sends no chunk
                        last = result.arrived(start, last)
                    if result.events == request.disconnect_after:
                        result.disconnected = True  # closing the stream aborts the request
                        break
        except KilnError as exc:
            result.status, result.error = 0, str(exc)
        result.latency_s = time.monotonic() - start
        return result

    results, duration = await drive(workload, concurrency, send)
    return summarize_results(results, duration, clients=concurrency)


async def run_offline(llm, workload: ServingWorkload, *, concurrency: int) -> dict:
    """The measured requests through ``llm.generate_async`` in a closed loop of ``concurrency`` slots, each taking
    the next request as soon as its last one finishes, as the clients refill theirs, but with no streaming and no
    HTTP: the engine's own throughput on the workload at the clients' concurrency."""
    pending, outputs = iter(workload.requests), []

    async def slot() -> None:
        for request in pending:  # shared by the slots: each takes the next request not yet taken
            outputs.append(await llm.generate_async(request.prompt, _params(request)))

    start = time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(concurrency)))
    duration = time.perf_counter() - start
    tokens = sum(len(out.token_ids) for out in outputs)
    return {"requests": len(outputs), "output_tokens": tokens, "duration_s": round(duration, 3),
            "output_tokens_per_s": round(tokens / duration, 2)}


def _params(request: ServingRequest):
    from kiln.runtime import SamplingParams

    return SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)


def _by_status(results: list[RequestResult]) -> dict[str, int]:
    """How many of ``results`` had each HTTP status ("connection error": none came)."""
    return dict(Counter(str(r.status) if r.status else "connection error" for r in results))


def _tokens_counted(ok: list[RequestResult]) -> str:
    """How the succeeded requests' tokens were counted: ``usage``, or estimated (for how many, where not all)."""
    if not (estimated := sum(r.without_usage for r in ok)):
        return "usage"
    share = "" if estimated == len(ok) else f" for {estimated} of {len(ok)} requests"
    return f"estimated{share}: the server sent no usage (max_tokens where a request ended by length, else one a chunk)"


def summarize_results(results: list[RequestResult], duration_s: float, **context: object) -> dict:
    """Throughput, latency percentiles and how many tokens each piece of output carried."""
    ok = [r for r in results if r.status == 200 and r.error is None and not r.disconnected]
    failed = [r for r in results if (r.status != 200 or r.error is not None) and not r.disconnected]
    disconnected = sum(r.disconnected for r in results)
    if not ok and not disconnected:  # every client going away, as --disconnect 1 asks, is a soak test, not a failure
        errors = {r.error or f"HTTP {r.status}" for r in results}
        raise LoadTestError(f"none of {len(results)} requests succeeded: {'; '.join(sorted(errors))[:400]}")
    tokens = sum(r.completion_tokens for r in ok)
    errors = Counter(r.error[:160] for r in failed if r.error is not None)
    return {
        **context,
        "requests": len(results),
        "succeeded": len(ok),
        "disconnected": disconnected,
        "failed": len(failed),
        "statuses": _by_status(results),  # every response, succeeded or not
        "failed_statuses": _by_status(failed),  # a failed 200: its stream ended with an error event or unfinished
        "tokens_counted": _tokens_counted(ok),
        "errors": dict(errors.most_common(5)),  # the commonest error messages of the failed requests
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(len(ok) / duration_s, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / duration_s, 2),
        "tokens_per_event": round(tokens / max(1, sum(r.events for r in ok)), 3),
        "ttft_ms": summarize([r.ttft_s for r in ok if r.ttft_s is not None], 1000, digits=2),
        "itl_ms": summarize([gap for r in ok for gap in r.gaps_s], 1000, digits=2),
        "tpot_ms": summarize([tpot for r in ok if (tpot := time_per_output_token(r)) is not None], 1000, digits=2),
        "latency_ms": summarize([r.latency_s for r in ok], 1000, digits=2),
    }
