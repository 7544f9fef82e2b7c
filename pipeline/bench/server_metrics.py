"""What a Kiln server's ``/metrics`` says about a load test: CPU seconds and resident memory of the server's process,
of its engine process and of its tensor-parallel workers on the server's host (summed over their ranks), and whether
the engine went idle with every KV block free afterwards."""

from __future__ import annotations

import asyncio
import time

WATCHED = {"process_cpu_seconds_total": "server_cpu_s", "kiln_engine_process_cpu_seconds_total": "engine_cpu_s",
           "process_resident_memory_bytes": "server_rss", "kiln_engine_process_resident_memory_bytes": "engine_rss",
           "kiln_kv_blocks_used": "kv_blocks_used", "kiln_running_requests": "running", "kiln_queue_depth": "waiting"}
# one series per rank, summed
BY_RANK = {"kiln_engine_worker_process_cpu_seconds_total": "workers_cpu_s",
           "kiln_engine_worker_process_resident_memory_bytes": "workers_rss"}
# the tokens the engine generated, a client's gone away mid-stream too (vLLM's counter, labelled with model_name)
GENERATED = "vllm:generation_tokens_total"
ROLES = (("server", "server"), ("engine_process", "engine"), ("tp_workers", "workers"))
IDLE = ("running", "waiting", "kv_blocks_used")


class MetricsUnavailableError(Exception):
    """``GET /metrics`` failed: the server did not answer it, or answered with an error."""


async def scrape(url: str) -> dict[str, float]:
    """The watched samples of the server's ``/metrics`` (empty for a server that has none of them);
    MetricsUnavailableError when it cannot be read."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with aiohttp.ClientSession() as session, session.get(f"{url.rstrip('/')}/metrics") as response:
            if response.status != 200:
                raise MetricsUnavailableError(f"GET /metrics failed: HTTP {response.status}")
            text = await response.text()
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise MetricsUnavailableError(f"GET /metrics failed: {type(exc).__name__}: {exc}") from None
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in WATCHED and not sample.labels:
                found[WATCHED[sample.name]] = sample.value
            elif sample.name in BY_RANK and set(sample.labels) == {"rank"}:
                found[BY_RANK[sample.name]] = found.get(BY_RANK[sample.name], 0.0) + sample.value
            elif sample.name == GENERATED:
                found["generated"] = found.get("generated", 0.0) + sample.value
    return found


async def scrape_when_idle(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """``scrape`` once no request runs or waits and no KV block is held, or after ``timeout_s`` (then as it is)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await scrape(url)
        idle = not any(found.get(name) for name in IDLE)
        if idle or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.2)


async def usage_after_run(url: str, after_warmup: dict[str, float] | MetricsUnavailableError, tokens: int,
                          client_cpu_s: float) -> dict:
    """``server_usage`` from ``after_warmup`` (the scrape after the warm-up, or how it failed) and the server's
    ``/metrics`` now and once idle. Where a scrape failed, the figures that need it are null (an empty
    ``idle_after`` would read as nothing leaked), what was read is kept, and ``server_metrics_unavailable`` says
    why: a report never loses its server block."""
    why = []
    if isinstance(after_warmup, MetricsUnavailableError):
        why, after_warmup = [f"{after_warmup} after the warm-up"], {}
    try:
        after, idle = await scrape(url), await scrape_when_idle(url)
    except MetricsUnavailableError as exc:
        why.append(f"{exc} after the run" if why else str(exc))
        after, idle = {}, None
    if not why:
        return server_usage(after_warmup, after, idle, tokens, client_cpu_s)
    cpu = {role: None for role, key in ROLES if f"{key}_cpu_s" in (after or after_warmup)}  # reported, not known
    return {"cpu_us_per_token": {**cpu, "clients": _per_token(client_cpu_s, tokens)}, "resident_memory": None,
            "idle_after": None if idle is None else _idle_state(idle), "server_metrics_unavailable": "; ".join(why)}


def server_usage(after_warmup: dict[str, float], after: dict[str, float], idle: dict[str, float], tokens: int,
                 client_cpu_s: float) -> dict:
    """CPU microseconds per token by process (the server's processes per token they generated, those of clients
    that went away mid-stream too, where the server counts them; the clients' per token they received), resident
    memory after the warm-up and after the run (and its growth), and the engine's state once idle (null where the
    server does not report it)."""
    generated = (round(after["generated"] - after_warmup["generated"])
                 if "generated" in after and "generated" in after_warmup else tokens)
    cpu = {role: _per_token(after[f"{key}_cpu_s"] - after_warmup[f"{key}_cpu_s"], generated)
           for role, key in ROLES if f"{key}_cpu_s" in after and f"{key}_cpu_s" in after_warmup}
    memory = {role: {"after_warmup_mb": round(after_warmup[f"{key}_rss"] / 2**20, 1),
                     "after_mb": round(idle[f"{key}_rss"] / 2**20, 1),
                     "growth": round(idle[f"{key}_rss"] / after_warmup[f"{key}_rss"] - 1, 4)}
              for role, key in ROLES if f"{key}_rss" in after_warmup and f"{key}_rss" in idle}
    return {"cpu_us_per_token": {**cpu, "clients": _per_token(client_cpu_s, tokens)},
            "resident_memory": memory,
            "idle_after": _idle_state(idle)}


def _idle_state(idle: dict[str, float]) -> dict[str, int | None]:
    return {name: int(idle[name]) if name in idle else None for name in IDLE}


def _per_token(cpu_s: float, tokens: int) -> float | None:
    """Microseconds of ``cpu_s`` per token; None for no token (a run whose every client went away first)."""
    return round(cpu_s * 1e6 / tokens, 1) if tokens > 0 else None
