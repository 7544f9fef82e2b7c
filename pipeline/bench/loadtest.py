"""``kiln loadtest URL | CONFIG | ENGINE_DIR | KEY``: N concurrent streaming clients against an OpenAI-compatible
server; reports throughput, time to first token and inter-token latency. Given an engine rather than a URL, it
serves that engine on a loopback port for the duration of the test."""

from __future__ import annotations

import asyncio
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated

import typer
from rich.table import Table

from kiln.pipeline.console import friendly_errors, print_json, stderr, stdout
from kiln.pipeline.runtime_env import runtime_options
from kiln.runtime.errors import KilnError
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.stats import summarize


class LoadTestError(KilnError):
    """The server could not be reached, or answered none of the requests."""


@dataclass
class RequestResult:
    """One streamed request as the client saw it (seconds on the client's monotonic clock)."""

    status: int
    ttft_s: float | None = None
    latency_s: float | None = None
    completion_tokens: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)
    error: str | None = None


def _payload(model: str, prompt: str, max_tokens: int, chat: bool, ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.0, "ignore_eos": ignore_eos}
    if chat:
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


def _chunk_text(chunk: dict) -> str:
    choice = (chunk.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _one_request(client, path: str, payload: dict) -> RequestResult:
    start = time.monotonic()
    result = RequestResult(status=0)
    last = None
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
                continue
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
            if _chunk_text(chunk):
                now = time.monotonic()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.chunk_gaps_s.append(now - last)
                last = now
    result.latency_s = time.monotonic() - start
    return result


async def run_load(url: str, *, clients: int, requests: int, max_tokens: int, prompt: str, chat: bool = False,
                   ignore_eos: bool = True, api_key: str | None = None, model: str | None = None,
                   timeout_s: float = 600.0) -> dict:
    """Send `requests` streaming requests from `clients` concurrent clients; return the figures (latencies in ms)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout_s)) as client:
        try:
            models = (await client.get("/v1/models")).raise_for_status().json()
        except httpx.HTTPError as exc:
            raise LoadTestError(f"{url}: cannot list models ({exc}): is the server up and the key right?") from None
        model = model or models["data"][0]["id"]
        payload = _payload(model, prompt, max_tokens, chat, ignore_eos)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        pending = iter(range(requests))
        results: list[RequestResult] = []

        async def client_loop() -> None:
            for _ in pending:
                try:
                    results.append(await _one_request(client, path, payload))
                except httpx.HTTPError as exc:
                    results.append(RequestResult(status=0, error=f"{type(exc).__name__}: {exc}"))

        start = time.monotonic()
        await asyncio.gather(*(client_loop() for _ in range(clients)))
        duration = time.monotonic() - start
    return summarize_results(results, duration, url=url, model=model, clients=clients, max_tokens=max_tokens,
                             chat=chat)


def summarize_results(results: list[RequestResult], duration_s: float, **context: object) -> dict:
    """Throughput and latency percentiles of a load test."""
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
        "ttft_ms": _rounded(summarize([r.ttft_s for r in ok if r.ttft_s is not None], 1000)),
        "itl_ms": _rounded(summarize([gap for r in ok for gap in r.chunk_gaps_s], 1000)),
        "latency_ms": _rounded(summarize([r.latency_s for r in ok], 1000)),
    }


def _rounded(summary: dict) -> dict:
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in summary.items()}


def print_report(report: dict) -> None:
    """The figures a person came for, in a few aligned rows."""
    stdout.print(f"{report['succeeded']}/{report['requests']} requests from {report['clients']} clients in "
                 f"{report['duration_s']:.1f} s against {report['model']} ({report['url']})", highlight=False)
    stdout.print(f"throughput  {report['output_tokens_per_s']:.1f} tokens/s, {report['requests_per_s']:.2f} "
                 f"requests/s ({report['output_tokens']} tokens)", highlight=False)
    table = Table(box=None, header_style="bold")
    for column in ("ms", "p50", "p99", "mean", "max"):
        table.add_column(column, justify="right" if column != "ms" else "left")
    for name, key in (("TTFT", "ttft_ms"), ("inter-token", "itl_ms"), ("latency", "latency_ms")):
        row = report[key]
        table.add_row(name, *(f"{row[p]:.1f}" if p in row else "-" for p in ("p50", "p99", "mean", "max")))
    stdout.print(table)
    if report["failed"]:
        stdout.print(f"[yellow]{report['failed']} failed[/]: {report['statuses']}", highlight=False)


@contextmanager
def _server_for(target: str, api_key: str | None, options: RuntimeOptions):
    """The URL to test: `target` itself, or a loopback server over the engine `target` names."""
    if target.startswith(("http://", "https://")):
        yield target, api_key
        return
    from kiln.pipeline.serve_command import require_serve_extra, serve_target

    require_serve_extra()
    from kiln.runtime.server import ServerThread, create_app

    resolved = serve_target(target, options)
    settings = resolved.settings(api_key=api_key)
    llm = resolved.loader(options)()
    try:
        with ServerThread(create_app(llm, resolved.engine_dir, settings), "127.0.0.1", 0) as server:
            stderr.print(f"serving {resolved.engine_dir} on {server.url} for the load test", highlight=False)
            yield server.url, settings.api_key
    finally:
        llm.close()


@friendly_errors
def loadtest(
    target: Annotated[str, typer.Argument(help="A server URL (http://127.0.0.1:8000), or a config, engine directory "
                                               "or cache key to serve on loopback for the test.")],
    clients: Annotated[int, typer.Option(min=1, help="Concurrent clients, each streaming one request at a time.")] = 8,
    requests: Annotated[int, typer.Option(min=1, help="Requests in all, shared among the clients.")] = 64,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per request.")] = 32,
    prompt: Annotated[str, typer.Option(help="The prompt every request sends.")] = "Once upon a time",
    chat: Annotated[bool, typer.Option("--chat", help="Use /v1/chat/completions (default /v1/completions).")] = False,
    ignore_eos: Annotated[bool, typer.Option(help="Generate max_tokens whatever the EOS (comparable runs).")] = True,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="KILN_API_KEY")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda, when serving an engine for the test.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable object on stdout.")] = False,
) -> None:
    """Measure a server under N concurrent streaming clients: throughput, TTFT and inter-token p50/p99."""
    with _server_for(target, api_key, runtime_options(os.environ, device=device)) as (url, key):
        report = asyncio.run(run_load(url, clients=clients, requests=requests, max_tokens=max_tokens, prompt=prompt,
                                      chat=chat, ignore_eos=ignore_eos, api_key=key))
    print_json(report) if json_out else print_report(report)
