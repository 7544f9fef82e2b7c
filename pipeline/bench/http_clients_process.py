"""``kiln loadtest``'s HTTP clients in processes of their own. A server under test in the load test's own process
would otherwise share its interpreter (and GIL) with the clients, and one client event loop handling a burst of new
requests serially would add its own queueing to the latencies it measures. The clients split the requests (every
K-th, so that arrivals keep their process) and the concurrency, warm up, and start the measurement at one shared
instant. ``python -m kiln.pipeline.bench.http_clients_process`` is one such process: the job as a JSON line on stdin,
``ready`` on stdout after its warm-up, then the start (Unix time) on stdin, and its results as JSON on stdout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict

from kiln.pipeline.bench.serving_clients import LoadTestError, RequestResult, http_results, summarize_results
from kiln.pipeline.bench.serving_workload import ServingWorkload
from kiln.runtime.errors import KilnError
from kiln.runtime.kiln_python import kiln_module_command

CLIENTS_PER_PROCESS = 16  # a process's event loop handles a burst of this many new requests in about a millisecond
START_DELAY_S = 0.05


def client_processes(concurrency: int, requests: int) -> int:
    """How many client processes a run gets: one per ``CLIENTS_PER_PROCESS`` clients, at most a quarter of the CPUs
    (the server and its engine need the rest) and no more than the requests."""
    return max(1, min(concurrency // CLIENTS_PER_PROCESS, (os.cpu_count() or 1) // 4, requests))


async def run_http_apart(url: str, workload: ServingWorkload, *, concurrency: int, chat: bool,
                         api_key: str | None, model: str, processes: int,
                         warmed_up: Callable[[], Awaitable[None]] | None = None) -> dict:
    """``run_http``'s report for the workload, its clients spread over ``processes`` child processes; the report
    adds their number and their CPU seconds over the measurement, warm-up left out (``client_cpu_s``).
    ``warmed_up`` is awaited between the warm-up and the measurement."""
    shares = [{"url": url, "chat": chat, "api_key": api_key, "model": model,
               "concurrency": concurrency // processes + (i < concurrency % processes),
               "workload": ServingWorkload(workload.requests[i::processes], workload.warmup[i::processes],
                                           workload.arrivals_s[i::processes]).to_json()} for i in range(processes)]
    argv, environment = kiln_module_command("kiln.pipeline.bench.http_clients_process")
    children = [await asyncio.create_subprocess_exec(*argv, env=environment, stdin=asyncio.subprocess.PIPE,
                                                     stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                for _ in shares]
    try:
        for child, share in zip(children, shares, strict=True):
            child.stdin.write(json.dumps(share).encode() + b"\n")
        for child in children:
            if await child.stdout.readline() != b"ready\n":
                raise await _failure(child)
        if warmed_up is not None:
            await warmed_up()
        start_at = time.time() + START_DELAY_S
        for child in children:
            child.stdin.write(f"{start_at}\n".encode())
            child.stdin.close()
        outputs = []
        for child in children:
            out = await child.stdout.read()
            if await child.wait() != 0:
                raise await _failure(child)
            outputs.append(json.loads(out))
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
    results = [RequestResult(**r) for out in outputs for r in out["results"]]
    report = summarize_results(results, max(out["duration_s"] for out in outputs), url=url, model=model,
                               clients=concurrency, chat=chat)
    return {**report, "client_processes": processes, "client_cpu_s": sum(out["cpu_s"] for out in outputs)}


async def _failure(child: asyncio.subprocess.Process) -> LoadTestError:
    with contextlib.suppress(ProcessLookupError):
        child.kill()
    code = await child.wait()
    reason = (await child.stderr.read()).decode(errors="replace").strip()[-600:]
    return LoadTestError(f"a load test client process failed (exit {code}): {reason}")


async def _run(job: dict) -> dict:
    """One client process's share of the run; ``cpu_s``: its CPU seconds from the start signal, after its imports
    and warm-up (the window the server's CPU is measured over), to its last request's end."""
    loop = asyncio.get_running_loop()
    cpu_at_start = []

    async def ready() -> float:
        print("ready", flush=True)
        start_at = float(await loop.run_in_executor(None, sys.stdin.readline))
        cpu_at_start.append(_cpu_s())
        return time.monotonic() + (start_at - time.time())

    results, duration, _ = await http_results(job["url"], ServingWorkload.from_json(job["workload"]),
                                              concurrency=job["concurrency"], chat=job["chat"],
                                              api_key=job["api_key"], model=job["model"], ready=ready)
    return {"results": [asdict(r) for r in results], "duration_s": duration, "cpu_s": _cpu_s() - cpu_at_start[0]}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    try:
        output = asyncio.run(_run(json.loads(sys.stdin.readline())))
    except KilnError as exc:
        print(exc, file=sys.stderr)
        return 1
    json.dump(output, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
