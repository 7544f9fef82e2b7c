"""The three ways ``kiln loadtest`` runs a workload, measured alike: streaming HTTP clients against a server,
asyncio clients streaming from the embedded ``LLM`` in this process (no HTTP), and the engine offline (every request
at once through ``LLM.generate``). Comparing them says where serving loses time: HTTP and the server, or the stream
path between the engine thread and its callers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kiln.pipeline.bench.serving_workload import ServingRequest, ServingWorkload
from kiln.runtime.errors import KilnError
from kiln.runtime.stats import summarize


class LoadTestError(KilnError):
    """The server could not be reached, or answered none of the requests."""


@dataclass
class RequestResult:
    """One streamed request as its client saw it (seconds on the client's monotonic clock): ``events`` is how many
    pieces of the output arrived (a piece may carry several tokens)."""

    status: int
    ttft_s: float | None = None
    latency_s: float | None = None
    completion_tokens: int = 0
    events: int = 0
    gaps_s: list[float] = field(default_factory=list)
    error: str | None = None

    def arrived(self, start: float, last: float | None) -> float:
        """Note one piece of output arriving now; returns the time of it."""
        now = time.monotonic()
        if last is None:
            self.ttft_s = now - start
        else:
            self.gaps_s.append(now - last)
        self.events += 1
        return now


async def drive(workload: ServingWorkload, concurrency: int,
                send: Callable[[ServingRequest], Awaitable[RequestResult]]) -> tuple[list[RequestResult], float]:
    """Run the warm-up requests, then the measured ones at their arrival times with at most ``concurrency`` in
    flight; returns the measured results and the seconds from the first arrival to the last completion."""
    gate = asyncio.Semaphore(concurrency)

    async def one(request: ServingRequest, at: float, origin: float) -> RequestResult:
        await asyncio.sleep(max(0.0, origin + at - time.monotonic()))
        async with gate:
            return await send(request)

    warm = time.monotonic()
    await asyncio.gather(*(one(r, 0.0, warm) for r in workload.warmup))
    start = time.monotonic()
    results = await asyncio.gather(*(one(r, at, start) for r, at in zip(workload.requests, workload.arrivals_s,
                                                                        strict=True)))
    return list(results), time.monotonic() - start


async def run_http(url: str, workload: ServingWorkload, *, concurrency: int, chat: bool = False,
                   api_key: str | None = None, model: str | None = None, timeout_s: float = 600.0) -> dict:
    """The workload as streaming requests to an OpenAI-compatible server at ``url``; the report (latencies in ms)."""
    import httpx

    if chat and workload.uses_token_ids:
        raise LoadTestError("--chat sends messages, which are text: random token prompts (--input-len) go to "
                            "/v1/completions; leave out --chat")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout_s)) as client:
        model = model or (await model_card(client, url))["id"]
        path = "/v1/chat/completions" if chat else "/v1/completions"

        async def send(request: ServingRequest) -> RequestResult:
            try:
                return await _one_http_request(client, path, _payload(model, request, chat))
            except httpx.HTTPError as exc:
                return RequestResult(status=0, error=f"{type(exc).__name__}: {exc}")

        results, duration = await drive(workload, concurrency, send)
    return summarize_results(results, duration, url=url, model=model, clients=concurrency, chat=chat)


async def model_card(client, url: str) -> dict:
    """The first model the server lists (Kiln's card also has the engine's ``vocab_size`` and ``max_model_len``)."""
    import httpx

    try:
        return (await client.get("/v1/models")).raise_for_status().json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise LoadTestError(f"{url}: cannot list models ({exc}): is the server up and the key right?") from None


def _payload(model: str, request: ServingRequest, chat: bool) -> dict:
    body = {"model": model, "max_tokens": request.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}
    if chat:
        return {**body, "messages": [{"role": "user", "content": request.prompt}]}
    return {**body, "prompt": request.prompt}


async def _one_http_request(client, path: str, payload: dict) -> RequestResult:
    start = time.monotonic()
    result, last = RequestResult(status=0), None
    async with client.stream("POST", path, json=payload) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")[:200]
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = chunk["error"].get("message")
            elif chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
            elif _carries_output(chunk):
                last = result.arrived(start, last)
    result.latency_s = time.monotonic() - start
    return result


def _carries_output(chunk: dict) -> bool:
    """Whether an SSE chunk brings generated output (a chat stream's first chunk only names the role)."""
    choice = (chunk.get("choices") or [{}])[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content") or choice.get("finish_reason"))


async def run_in_process(llm, workload: ServingWorkload, *, concurrency: int) -> dict:
    """The workload as asyncio clients streaming from ``llm`` in this process (no HTTP, no server)."""

    async def send(request: ServingRequest) -> RequestResult:
        start = time.monotonic()
        result, last = RequestResult(status=200), None
        try:
            async with contextlib.aclosing(llm.stream(request.prompt, _params(request))) as stream:
                async for delta in stream:
                    result.completion_tokens += len(delta.token_ids)
                    if delta.token_ids:
                        last = result.arrived(start, last)
        except KilnError as exc:
            result.status, result.error = 0, str(exc)
        result.latency_s = time.monotonic() - start
        return result

    results, duration = await drive(workload, concurrency, send)
    return summarize_results(results, duration, clients=concurrency)


def run_offline(llm, workload: ServingWorkload) -> dict:
    """The measured requests all at once through ``llm.generate``: the engine's own throughput on the workload."""
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in workload.requests], [_params(r) for r in workload.requests])
    duration = time.perf_counter() - start
    tokens = sum(len(out.token_ids) for out in outputs)
    return {"requests": len(outputs), "output_tokens": tokens, "duration_s": round(duration, 3),
            "output_tokens_per_s": round(tokens / duration, 2)}


def _params(request: ServingRequest):
    from kiln.runtime import SamplingParams

    return SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)


def summarize_results(results: list[RequestResult], duration_s: float, **context: object) -> dict:
    """Throughput, latency percentiles and how many tokens each piece of output carried."""
    ok = [r for r in results if r.status == 200 and r.error is None]
    if not ok:
        errors = {r.error or f"HTTP {r.status}" for r in results}
        raise LoadTestError(f"none of {len(results)} requests succeeded: {'; '.join(sorted(errors))[:400]}")
    tokens = sum(r.completion_tokens for r in ok)
    statuses: dict[str, int] = {}
    for r in results:
        key = str(r.status) if r.status else "connection error"
        statuses[key] = statuses.get(key, 0) + 1
    return {
        **context,
        "requests": len(results),
        "succeeded": len(ok),
        "failed": len(results) - len(ok),
        "statuses": statuses,
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(len(ok) / duration_s, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / duration_s, 2),
        "tokens_per_event": round(tokens / max(1, sum(r.events for r in ok)), 3),
        "ttft_ms": _rounded(summarize([r.ttft_s for r in ok if r.ttft_s is not None], 1000)),
        "itl_ms": _rounded(summarize([gap for r in ok for gap in r.gaps_s], 1000)),
        "latency_ms": _rounded(summarize([r.latency_s for r in ok], 1000)),
    }


def _rounded(summary: dict) -> dict:
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in summary.items()}
