"""``kiln loadtest URL | CONFIG | ENGINE_DIR | KEY``: streaming clients against an OpenAI-compatible server, as
serving benchmarks measure them (``serving_workload``): throughput, time to first token, inter-token and end-to-end
latency. Given an engine rather than a URL, it serves that engine on a loopback port for the test and also runs the
same workload through the engine offline at the same concurrency (and with ``--in-process``, through ``LLM.stream``
without HTTP), so one command prints the server's efficiency: served tokens/s over the engine's own."""

from __future__ import annotations

import asyncio
import math
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit

import typer
from rich.markup import escape
from rich.table import Table

from kiln.pipeline.bench.http_clients_process import client_processes, run_http_apart
from kiln.pipeline.bench.provenance import run_record, runtime_record
from kiln.pipeline.bench.server_metrics import MetricsUnavailableError, scrape, usage_after_run
from kiln.pipeline.bench.serving_clients import (
    LoadTestError,
    count_prompt_tokens,
    fetch_model_card,
    run_in_process,
    run_offline,
)
from kiln.pipeline.bench.serving_workload import (
    ServingWorkload,
    card_limits,
    check_fits,
    make_workload,
    text_prompts,
    with_fresh_token_ids,
)
from kiln.pipeline.console import friendly_errors, print_json, stderr, stdout
from kiln.pipeline.float_flags import finite_float
from kiln.pipeline.runtime_env import runtime_options
from kiln.runtime.engine import plan_limits
from kiln.runtime.errors import KilnError
from kiln.runtime.options import RuntimeOptions

if TYPE_CHECKING:
    from kiln.pipeline.serve_command import ServeTarget

__all__ = ["LoadTestError", "loadtest"]

LATENCIES = (("TTFT", "ttft_ms"), ("inter-token", "itl_ms"), ("per output token", "tpot_ms"), ("latency", "latency_ms"))


def print_report(report: dict) -> None:
    """The figures a person came for, in a few aligned rows."""
    stdout.print(f"{report['succeeded']}/{report['requests']} requests, at most {report['clients']} at once, in "
                 f"{report['duration_s']:.1f} s against {report['model']} ({report['url']})", highlight=False)
    stdout.print(f"throughput  {report['output_tokens_per_s']:,.1f} tokens/s, {report['requests_per_s']:.2f} "
                 f"requests/s ({report['output_tokens']} tokens, {report['tokens_per_event']:.2f} per event)",
                 highlight=False)
    table = Table(box=None, header_style="bold")
    for column in ("ms", "p50", "p95", "p99", "mean", "max"):
        table.add_column(column, justify="right" if column != "ms" else "left")
    for name, key in LATENCIES:
        row = report[key]
        table.add_row(name, *(f"{row[p]:.1f}" if row.get(p) is not None else "-"
                              for p in ("p50", "p95", "p99", "mean", "max")))
    stdout.print(table)
    if report["tokens_counted"] != "usage":
        stdout.print(f"[yellow]tokens counted as {escape(report['tokens_counted'])}[/]", markup=True, highlight=False)
    if report["disconnected"]:
        stdout.print(f"{report['disconnected']} clients went away mid-stream, as --disconnect asked", highlight=False)
    if report["failed"]:
        stdout.print(f"[yellow]{report['failed']} failed[/], by HTTP status: {escape(str(report['failed_statuses']))}",
                     markup=True, highlight=False)
        for message, count in report["errors"].items():
            stdout.print(f"  {count} x {escape(message)}", markup=True, highlight=False)
    if "offline" in report:
        served = (f"served at {report['efficiency']:.1%} of it" if "efficiency" in report else
                  "no efficiency, as the arrival rate or the disconnecting clients set the served rate")
        stdout.print(f"engine offline  {report['offline']['output_tokens_per_s']:,.1f} tokens/s on the same "
                     f"workload: {served}", highlight=False)
    if "server" in report:
        _print_server(report["server"])
    if "in_process" in report:
        inner = report["in_process"]
        stdout.print(f"in-process      {inner['output_tokens_per_s']:,.1f} tokens/s through LLM.stream, TTFT p50 "
                     f"{inner['ttft_ms']['p50'] or 0:.1f} ms, inter-token p50 {inner['itl_ms']['p50'] or 0:.1f} "
                     f"ms", highlight=False)


def _print_server(server: dict) -> None:
    """What the server's /metrics said of its processes, and why what is not known could not be read."""
    stdout.print("CPU per token   " + ", ".join(f"{role.replace('_', ' ')} " + ("?" if us is None else f"{us:,.0f} µs")
                                               for role, us in server["cpu_us_per_token"].items()), highlight=False)
    unavailable = server.get("server_metrics_unavailable")
    if server["idle_after"] is None:
        stdout.print(f"[yellow]after the run   not known: {escape(unavailable)}[/]", markup=True, highlight=False)
        return
    if unavailable is not None:
        stdout.print(f"[yellow]/metrics        not read: {escape(unavailable)}[/]", markup=True, highlight=False)
    memory = "not known" if server["resident_memory"] is None else ", ".join(
        f"{role.replace('_', ' ')} {m['after_warmup_mb']:,.0f} → {m['after_mb']:,.0f} MB ({m['growth']:+.1%})"
        for role, m in server["resident_memory"].items())
    idle = {name: "?" if count is None else count for name, count in server["idle_after"].items()}
    stdout.print(f"after the run   {idle['running']} running, {idle['waiting']} waiting, {idle['kv_blocks_used']} KV "
                 f"blocks held; resident memory since the warm-up: {memory or 'not reported'}", highlight=False)


def _engine_target(target: str, options: RuntimeOptions) -> ServeTarget | None:
    """The engine `target` names (built first when it is a config), or None for a server URL."""
    if target.startswith(("http://", "https://")):
        _check_url(target)
        return None
    if re.fullmatch(r"[\w.-]+:[0-9]+/?", target) and not Path(target).exists():  # HOST:PORT, no scheme
        raise typer.BadParameter(f"{target}: a server's URL starts with its scheme: give http://{target}")
    from kiln.pipeline.serve_command import require_serve_extra, serve_target

    require_serve_extra()
    return serve_target(target, options)


def _check_url(url: str) -> None:
    """A server URL is a scheme, a host and a port: the server's root, under which /v1/... and /metrics are."""
    parsed = urlsplit(url)
    try:
        parsed.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        raise typer.BadParameter(f"{url}: not a server URL ({exc}); give http://HOST:PORT") from None
    if not parsed.hostname:
        raise typer.BadParameter(f"{url}: not a server URL (no host); give http://HOST:PORT")
    if parsed.path not in ("", "/") or parsed.query:
        root = f"{parsed.scheme}://{parsed.netloc}"
        raise typer.BadParameter(f"{url}: give the server's root, {root}, without a path ({parsed.path}): kiln "
                                 f"loadtest adds /v1/completions and /metrics itself")


@contextmanager
def _server_for(target: str, resolved: ServeTarget | None, api_key: str | None, options: RuntimeOptions):
    """The URL to test and the LLM behind it: `target` itself (and None), or a loopback server over the engine
    `resolved`."""
    if resolved is None:
        yield target, api_key, None
        return
    from kiln.runtime.server import ServerThread, create_app

    settings = resolved.settings(api_key=api_key)
    llm = resolved.loader(options)()
    try:
        with ServerThread(create_app(llm, resolved.engine_dir, settings), "127.0.0.1", 0) as server:
            stderr.print(f"serving {resolved.engine_dir} on {server.url} for the load test", highlight=False)
            yield server.url, settings.api_key, llm
    finally:
        llm.close()


async def _measure(url: str, api_key: str | None, llm, workload_options: dict, *, concurrency: int, chat: bool,
                   vocab_size: int | None, offline: bool, in_process: bool) -> dict:
    """Make the workload (the server's model card supplies the vocabulary for random token ids) and run it against
    the server, its clients in processes of their own; with what the server's /metrics said of its processes
    around the run; then through the engine offline and in-process when this process holds it."""
    card = await fetch_model_card(url, api_key, on_wait=lambda message: stderr.print(message, highlight=False))
    vocab_size = vocab_size or card.get("vocab_size")
    workload = make_workload(**workload_options, vocab_size=vocab_size)
    await _check_fits_server(url, api_key, card, workload, chat)
    snapshots: dict[str, dict[str, float] | MetricsUnavailableError] = {}

    async def warmed_up() -> None:
        try:
            snapshots["after_warmup"] = await scrape(url)
        except MetricsUnavailableError as exc:  # kept: the server block says so, with what is read after the run
            snapshots["after_warmup"] = exc

    report = await run_http_apart(url, workload, concurrency=concurrency, chat=chat, api_key=api_key,
                                  model=card["id"], processes=client_processes(concurrency, len(workload.requests)),
                                  warmed_up=warmed_up)
    client_cpu_s = report.pop("client_cpu_s")
    report["server"] = await usage_after_run(url, snapshots["after_warmup"], report["output_tokens"], client_cpu_s)
    report["workload"] = _describe(workload, workload_options)
    if llm is not None and in_process:
        report["in_process"] = await run_in_process(llm, _fresh(workload, workload_options, vocab_size, 1),
                                                    concurrency=concurrency)
    if llm is not None and offline:
        report["offline"] = await run_offline(llm, _fresh(workload, workload_options, vocab_size, 2),
                                              concurrency=concurrency)
        if math.isinf(workload_options["request_rate"]) and not workload_options["disconnect"]:
            # at a finite rate the arrivals set the served rate; clients that go away take fewer tokens
            report["efficiency"] = round(report["output_tokens_per_s"] / report["offline"]["output_tokens_per_s"], 4)
    return report


async def _check_fits_server(url: str, api_key: str | None, card: dict, workload: ServingWorkload,
                             chat: bool) -> None:
    """Refuse, before any request, a workload with a request the server's model card says it cannot hold (as for
    an engine served here), its text prompts counted by the server's ``/tokenize``."""
    if (limits := card_limits(card)) is None:
        return
    texts = text_prompts(workload)
    counted = await count_prompt_tokens(url, api_key, card["id"], texts, chat) if texts else {}
    if len(counted) < len(texts):
        stderr.print(f"{len(texts) - len(counted)} of {len(texts)} text prompts not counted: the server's /tokenize "
                     f"did not answer, so only their max_tokens is checked against its context", highlight=False)
    check_fits(workload, limits, counted)


def _fresh(workload: ServingWorkload, options: dict, vocab_size: int | None, phase: int) -> ServingWorkload:
    """The served workload again, its random token ids drawn anew from another seed so that no phase finds
    another's prompts in the prefix cache, its lengths kept so that the phases compare (a shared text prompt stays
    shared, as in the served run)."""
    if options["input_len"] is None:
        return workload
    return with_fresh_token_ids(workload, vocab_size, options["seed"] + phase)


def _describe(workload: ServingWorkload, options: dict) -> dict:
    prompts = [len(r.prompt) if not isinstance(r.prompt, str) else None for r in workload.requests]
    return {"requests": len(workload.requests), "warmup": len(workload.warmup),
            "request_rate": options["request_rate"] if math.isfinite(options["request_rate"]) else "inf",
            "input_tokens_mean": round(sum(prompts) / len(prompts), 1) if None not in prompts else None,
            "output_tokens_mean": round(sum(r.max_tokens for r in workload.requests) / len(workload.requests), 1),
            "prompt": None if workload.uses_token_ids else workload.requests[0].prompt,
            **{name: options[name] for name in ("seed", "input_len", "output_len", "spread", "disconnect")},
            "prompts_file": str(options["prompts_file"]) if options["prompts_file"] is not None else None}


class TooManyFailuresError(KilnError):
    """More of the measured requests failed than ``--max-failure-rate`` allows."""

    exit_code = 3


def _above_zero(value: float) -> float:
    """``--request-rate``: a rate above zero (NaN and 0 would give no arrivals at all)."""
    if not value > 0:
        raise typer.BadParameter(f"{value} is not a rate: give requests per second above 0, or inf for all at once")
    return value


@friendly_errors
def loadtest(
    target: Annotated[str, typer.Argument(help="A server URL (http://127.0.0.1:8000), or a config, engine directory "
                                               "or cache key to serve on loopback for the test.")],
    clients: Annotated[int, typer.Option("--clients", "--concurrency", min=1,
                                         help="Requests in flight at most (each client streams one at a time).")] = 8,
    requests: Annotated[int, typer.Option(min=1, help="Measured requests.")] = 64,
    request_rate: Annotated[float, typer.Option(
        callback=_above_zero, help="Poisson arrivals at this many requests/s (inf: all at once, as many as --clients "
                                   "allows).")] = math.inf,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per request (EOS ignored).")] = 32,
    prompt: Annotated[str | None, typer.Option(help="The prompt every request sends (default: 'Once upon a "
                                                    "time').")] = None,
    input_len: Annotated[int | None, typer.Option(min=1, help="Send random token ids of this many tokens instead "
                                                              "of --prompt.")] = None,
    output_len: Annotated[int | None, typer.Option(min=1, help="Tokens to generate per request (overrides "
                                                               "--max-tokens).")] = None,
    spread: Annotated[float, typer.Option(**finite_float(0.0, 1.0), help="Vary --input-len and --output-len (or "
                                                                         "--max-tokens) uniformly by this "
                                                                         "fraction.")] = 0.0,
    prompts_file: Annotated[Path | None, typer.Option(help="Prompts to send in turn: a text file (one a line), "
                                                           "JSONL with 'prompt' and optional 'max_tokens', or a .json "
                                                           "array of those, of texts or of ShareGPT conversations."
                                                      )] = None,
    warmup: Annotated[int, typer.Option(min=0, help="Requests sent first and not measured.")] = 1,
    disconnect: Annotated[float, typer.Option(
        **finite_float(0.0, 1.0), help="This share of the measured requests, drawn at random, disconnects after a "
                                       "random part of its output (a soak test).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of random prompts and arrivals.")] = 0,
    max_failure_rate: Annotated[float, typer.Option(
        **finite_float(0.0, 1.0), help="Exit 3, after the report, when more than this share of the measured requests "
                                       "failed (0 for a CI gate that takes no failure; default 1: report failures, "
                                       "exit 0 as vLLM's benchmark does). Requests that --disconnect drops do not "
                                       "count.")] = 1.0,
    vocab_size: Annotated[int | None, typer.Option(min=1, help="Token ids of --input-len prompts stay below this "
                                                               "(default: the server's model card).")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Use /v1/chat/completions (default /v1/completions).")] = False,
    offline: Annotated[bool | None, typer.Option("--offline/--no-offline", help="When serving the engine itself, "
                                                 "also run the workload through it offline and report the server's "
                                                 "efficiency (default: on).")] = None,
    in_process: Annotated[bool, typer.Option("--in-process", help="When serving the engine itself, also stream the "
                                                                  "workload from LLM.stream without HTTP.")] = False,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="KILN_API_KEY", help="The server's API key.")
                       ] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N, when serving an engine for the test.")
                      ] = None,
    engine_process: Annotated[bool, typer.Option(help="Serving an engine for the test, run it in a process of its "
                                                     "own, as kiln serve does, or on a thread of the server.")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable object on stdout.")] = False,
) -> None:
    """Measure a server under concurrent streaming clients: throughput, TTFT, inter-token and end-to-end latency
    p50/p95/p99, and, serving an engine itself, its efficiency against the engine offline."""
    workload_options = {"requests": requests, "warmup": warmup, "request_rate": request_rate, "seed": seed,
                        "prompt": prompt, "max_tokens": output_len or max_tokens, "input_len": input_len,
                        "output_len": output_len, "spread": spread, "prompts_file": prompts_file,
                        "disconnect": disconnect}
    if sum(given is not None for given in (prompt, input_len, prompts_file)) > 1:
        raise typer.BadParameter("--prompt, --input-len (random token ids) and --prompts-file each say what the "
                                 "requests send: give one")
    if vocab_size is not None and input_len is None:
        raise typer.BadParameter("--vocab-size bounds the random token ids of --input-len prompts, and the requests "
                                 "send text: give --input-len, or leave --vocab-size out")
    if chat and input_len is not None:
        raise typer.BadParameter("--chat sends messages, which are text: random token prompts (--input-len) go to "
                                 "/v1/completions; leave out one of them")
    options = runtime_options(os.environ, device=device, engine_process=engine_process)
    serving_only = [flag for flag, given in (("--in-process", in_process), ("--device", device is not None),
                                             ("--no-engine-process", not engine_process),
                                             ("--offline" if offline else "--no-offline", offline is not None))
                    if given]
    if serving_only and target.startswith(("http://", "https://")):
        verb = "applies" if len(serving_only) == 1 else "apply"
        raise typer.BadParameter(f"{', '.join(serving_only)} {verb} only when loadtest serves the engine itself (a "
                                 f"config, an engine directory or a cache key), and {target} is a running server: "
                                 f"leave {'it' if verb == 'applies' else 'them'} out, or give the engine")
    resolved = _engine_target(target, options)
    if resolved is not None:  # the workload checked against the engine before it loads (a prompts file read too)
        limits = plan_limits(resolved.engine_dir)
        check_fits(make_workload(**workload_options, vocab_size=vocab_size or limits.vocab_size), limits)
    run = run_record()
    with _server_for(target, resolved, api_key, options) as (url, key, llm):
        report = asyncio.run(_measure(url, key, llm, workload_options, concurrency=clients, chat=chat,
                                      vocab_size=vocab_size, offline=offline is not False, in_process=in_process))
    runtime = None if resolved is None else runtime_record(options)  # a running server's settings are its own
    print_json({**report, "runtime": runtime, "run": run}) if json_out else print_report(report)
    counted = report["requests"] - report["disconnected"]  # the soak's own disconnections are no failures
    if counted and report["failed"] / counted > max_failure_rate:
        raise TooManyFailuresError(f"{report['failed']} of {counted} requests failed, more than "
                                   f"--max-failure-rate {max_failure_rate:g} allows")
