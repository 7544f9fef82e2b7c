"""Prometheus metrics: server counters and latency histograms, plus engine gauges read from `llm.stats()` per scrape."""

from __future__ import annotations

import gzip
import re
import time
from collections.abc import Callable, Collection, Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    Summary,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.runtime.outputs import RequestOutput
from kiln.runtime.server.binned_histogram import BinnedHistogram, Observations
from kiln.runtime.server.errors import REFUSAL, REFUSAL_REASONS
from kiln.runtime.server.route_path import route_path
from kiln.runtime.server.vllm_metrics import VllmEngineCollector, VllmRequestMetrics, reported

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away before the response
CLIENT_GONE = "kiln.client_gone"  # set in the ASGI scope when a streamed response's client went away mid-stream
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/invocations", "/tokenize",
             "/detokenize", "/tokenizer_info", "/health", "/ping", "/metrics", "/version")
# prometheus-fastapi-instrumentator's defaults, as vLLM's server instruments itself with them
HTTP_DURATION_BUCKETS = (0.1, 0.5, 1.0)
HTTP_DURATION_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5,
                               5.0, 7.5, 10.0, 30.0, 60.0)
UNINSTRUMENTED = re.compile("/metrics|/health|/health/decode|/load|/ping|/version|/server_info")  # vLLM's excluded
HTTP_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"))


def _remote_cache_metrics(remote: dict) -> Iterator[Metric]:
    """The engine cache's remote tier, as this cache's statistics count it."""
    for name, doc, value in (
        ("hits", "Entries pulled from the remote engine cache", remote["hits"]),
        ("misses", "Local misses the remote engine cache did not have either", remote["misses"]),
        ("refused", "Remote entries refused on pull because a file did not match its sha256", remote["corrupt"]),
        ("errors", "Remote engine cache requests that failed (unreachable, denied)", remote["errors"]),
        ("pulled_bytes", "Bytes pulled from the remote engine cache", remote["pulled_bytes"]),
        ("pull_seconds", "Seconds spent pulling from the remote engine cache", remote["pull_seconds"]),
        ("pushed_bytes", "Bytes pushed to the remote engine cache", remote["pushed_bytes"]),
        ("push_seconds", "Seconds spent pushing to the remote engine cache", remote["push_seconds"]),
    ):
        yield CounterMetricFamily(f"kiln_engine_cache_remote_{name}", doc, value=value)


# the engine's figures read per scrape: (family, name, documentation, where the engine's statistics hold it)
ENGINE_FIGURES = (
    (GaugeMetricFamily, "kiln_queue_depth", "Requests waiting for the engine to schedule them", ("num_waiting",)),
    (GaugeMetricFamily, "kiln_running_requests", "Requests the engine is running", ("num_running",)),
    (GaugeMetricFamily, "kiln_kv_blocks_used", "KV cache blocks held by requests", ("kv_cache", "used_blocks")),
    (GaugeMetricFamily, "kiln_kv_blocks_free", "KV cache blocks free", ("kv_cache", "free_blocks")),
    (GaugeMetricFamily, "kiln_prefix_cache_hit_rate", "Share of prompt tokens served from the prefix cache (of KV "
     "blocks for a TensorRT-LLM engine)", ("prefix_cache", "hit_rate")),
    (CounterMetricFamily, "kiln_preemptions", "Requests preempted when KV blocks ran out", ("num_preemptions",)),
    (CounterMetricFamily, "kiln_engine_steps", "Engine steps run", ("num_steps",)),
    (CounterMetricFamily, "kiln_engine_steps_queued_ahead",
     "Engine steps queued on the device before the previous step's tokens were read", ("num_steps_queued_ahead",)),
)


class _EngineCollector:
    """Engine state at scrape time: queue, running requests, KV pool, prefix cache, preemptions, load. A figure the
    engine's backend does not report is left out, never read as 0."""

    def __init__(self, stats: Callable[[], dict | None], engine_cache: Callable[[], dict]) -> None:
        self._stats = stats
        self._engine_cache = engine_cache

    def collect(self) -> Iterator[Metric]:
        info = self._engine_cache()
        if info.get("hit_rate") is not None:
            yield GaugeMetricFamily("kiln_engine_cache_hit_rate", "Hit rate of the engine cache's lookups",
                                    value=info["hit_rate"])
        if info.get("hit") is not None:
            yield GaugeMetricFamily("kiln_engine_cache_hit", "1 when the served engine came from the cache",
                                    value=float(info["hit"]))
        if (remote := info.get("remote")) is not None:
            yield from _remote_cache_metrics(remote)
        stats = self._stats()
        yield GaugeMetricFamily("kiln_engine_up", "1 while the engine serves; 0 while it loads or after it failed",
                                value=float(stats is not None))
        if stats is None:
            return
        if (load_ms := stats.get("load_ms")) is not None:
            yield GaugeMetricFamily("kiln_engine_load_seconds", "Time the runtime took to load the served engine",
                                    value=load_ms / 1000)
        if (graphs := stats.get("cuda_graphs")) is not None:  # the native engine's, captured after the load
            yield GaugeMetricFamily("kiln_cuda_graphs_pending", "CUDA graphs not captured yet (0: the engine is warm)",
                                    value=graphs["pending"])
            yield GaugeMetricFamily("kiln_cuda_graphs_captured", "CUDA graphs captured", value=graphs["captured"])
        for family, name, documentation, path in ENGINE_FIGURES:
            if (value := reported(stats, path)) is not None:  # a figure the backend does not report has no series
                yield family(name, documentation, value=value)
        if (steps_by_kind := stats.get("steps_by_kind")) is not None:
            yield _step_seconds(steps_by_kind)


def _step_seconds(steps_by_kind: dict) -> Metric:
    """Engine steps' wall time by kind and part, from the totals of each kind."""
    step_seconds = CounterMetricFamily("kiln_engine_step_seconds",
                                       "Wall time of engine steps by kind (prefill, mixed, decode) and part "
                                       "(execute: running the model; host: the rest)", labels=["kind", "part"])
    for kind, totals in steps_by_kind.items():
        step_seconds.add_metric([kind, "execute"], totals["execute_s"])
        step_seconds.add_metric([kind, "host"], totals["duration_s"] - totals["execute_s"])
    return step_seconds


class _EngineProcessCollector(ProcessCollector):
    """CPU seconds and memory of the engine's own process (``kiln_engine_process_*``) when it runs in one."""

    def __init__(self, pid: Callable[[], int | None], registry: CollectorRegistry) -> None:
        self._engine_pid = pid
        super().__init__(namespace="kiln_engine", pid=pid, registry=registry)

    def collect(self) -> Iterator[Metric]:
        return iter(super().collect() if self._engine_pid() is not None else [])


class _WorkerProcessCollector:
    """CPU seconds and memory of each tensor-parallel worker process on this host, by ``rank``
    (``kiln_engine_worker_process_*``: the series ProcessCollector gives one process)."""

    def __init__(self, pids: Callable[[], dict[int, int]]) -> None:
        self._pids = pids

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for rank, pid in sorted(self._pids().items()):
            for metric in ProcessCollector("kiln_engine_worker", lambda pid=pid: pid, registry=None).collect():
                family = families.setdefault(metric.name, Metric(metric.name, metric.documentation, metric.type))
                family.samples += [sample._replace(labels={"rank": str(rank)}) for sample in metric.samples]
        return iter(families.values())


class HttpMetrics:
    """The series prometheus-fastapi-instrumentator adds by default, with its names, labels and buckets, so alerts
    written for vLLM's server (``http_requests_total{handler="/v1/chat/completions",status="5xx"}``) read Kiln's."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("http_requests", "Requests by method, status class (2xx, 4xx, 5xx) and handler",
                                ["method", "status", "handler"], registry=registry)
        self.request_size = Summary("http_request_size_bytes", "Content-Length of requests by handler (0 without one)",
                                    ["handler"], registry=registry)
        self.response_size = Summary("http_response_size_bytes",
                                     "Content-Length of responses by handler (0 without one: a stream)", ["handler"],
                                     registry=registry)
        self.duration_highr = Histogram("http_request_duration_highr_seconds",
                                        "Request latency until the response is complete, with many buckets",
                                        buckets=HTTP_DURATION_HIGHR_BUCKETS, registry=registry)
        self.duration = Histogram("http_request_duration_seconds",
                                  "Request latency until the response is complete, by handler", ["method", "handler"],
                                  buckets=HTTP_DURATION_BUCKETS, registry=registry)

    def observe(self, scope: Scope, handler: str, status: int, response_bytes: int, seconds: float) -> None:
        """Record one response to this request, as the instrumentator records it."""
        method = scope["method"] if scope["method"] in HTTP_METHODS else "other"  # a scanner's made-up methods
        self.requests.labels(method, f"{str(status)[0]}xx", handler).inc()
        self.request_size.labels(handler).observe(_content_length(scope["headers"]))
        self.response_size.labels(handler).observe(response_bytes)
        self.duration_highr.observe(seconds)
        self.duration.labels(method, handler).observe(seconds)


class ServerMetrics:
    """One registry per app, so several apps (tests, embedders) never collide in prometheus-client's global one.
    ``engine_pid`` gives the engine process's id when the engine runs in one (else None), ``worker_pids`` those of
    its tensor-parallel workers on this host by rank. Kiln's ``kiln_*`` metrics, vLLM's names for the same
    (``vllm:*``, labelled with ``model_name``) and the ``http_*`` series of vLLM's HTTP instrumentation."""

    def __init__(self, stats: Callable[[], dict | None], engine_cache: Callable[[], dict],
                 engine_pid: Callable[[], int | None], model_name: str, *,
                 worker_pids: Callable[[], dict[int, int]] = dict) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        _EngineProcessCollector(engine_pid, self.registry)
        self.registry.register(_WorkerProcessCollector(worker_pids))
        self.requests = Counter("kiln_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.refused = Counter("kiln_requests_refused", "Requests turned away with a 503 before any work, by why: "
                               "capacity (the queue is full: backpressure, not a failure), draining, loading, "
                               "load_failed, engine_stopped", ["reason"], registry=self.registry)
        for reason in REFUSAL_REASONS:  # every series there from the start, for rate() and alerts
            self.refused.labels(reason)
        self.time_to_first_token = Histogram("kiln_time_to_first_token_seconds",
                                             "From arrival at the engine to the first generated token",
                                             buckets=TTFT_BUCKETS, registry=self.registry)
        self.inter_token_latency = BinnedHistogram("kiln_inter_token_latency_seconds", "Between consecutive tokens",
                                                   ITL_BUCKETS, self.registry)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated for finished requests",
                                         registry=self.registry)
        self.registry.register(_EngineCollector(stats, engine_cache))
        self.registry.register(VllmEngineCollector(model_name, stats))
        self.vllm = VllmRequestMetrics(model_name, self.registry)
        self.http = HttpMetrics(self.registry)

    def observe(self, output: RequestOutput) -> None:
        """Record a finished request's latencies and token counts."""
        metrics = output.metrics
        if metrics.time_to_first_token is not None:
            self.time_to_first_token.observe(metrics.time_to_first_token)
        inter_token = Observations.of(metrics.inter_token_latencies)  # sorted once for all three of its histograms
        self.inter_token_latency.observe(inter_token)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(len(output.token_ids))
        self.vllm.observe(output, inter_token)

    def exposition(self, accept_encoding: str, names: Collection[str] = ()) -> tuple[bytes, dict[str, str]]:
        """The Prometheus text exposition, only the samples ``names`` names where given (``?name[]=``), gzipped where
        the scraper accepts that (as prometheus_client's ASGI app does both), and its headers. Never OpenMetrics,
        which Prometheus asks for first: prometheus_client writes its samples' names with vLLM's colons turned to
        underscores there, so no dashboard would find them."""
        registry = _Restricted(self.registry, names) if names else self.registry
        payload, headers = generate_latest(registry), {"Content-Type": CONTENT_TYPE_LATEST}
        if "gzip" in accept_encoding:
            payload, headers["Content-Encoding"] = gzip.compress(payload), "gzip"
        return payload, headers


class _Restricted:
    """The samples of a registry with these names only, as prometheus_client's ``restricted_registry`` gives them to
    its ``?name[]=`` (which finds only the collectors that describe themselves: the engine's collectors do not)."""

    def __init__(self, registry: CollectorRegistry, names: Collection[str]) -> None:
        self._registry = registry
        self._names = set(names)

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            if samples := [sample for sample in metric.samples if sample.name in self._names]:
                restricted = Metric(metric.name, metric.documentation, metric.type)
                restricted.samples = samples
                yield restricted


def endpoint_label(path: str) -> str:
    """A bounded label for a request path (unknown paths share one label, so scanners cannot blow up cardinality)."""
    if path in ENDPOINTS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


def handler_label(scope: Scope) -> str | None:
    """prometheus-fastapi-instrumentator's handler label: the template of the app's route the path matches (one
    serving another method, or the path with its trailing slash added or taken off, too), "none" for a path no route
    serves, so scanners cannot blow up cardinality; None for the handlers vLLM leaves uninstrumented (/metrics,
    /health, /ping, /version, ...)."""
    router, path = scope["app"].router, scope["path"]
    template = _route_template(router.routes, scope)
    if template is None and router.redirect_slashes and path != "/":  # the route a redirect would take it to
        trimmed = path.endswith("/")
        template = _route_template(router.routes, {**scope, "path": path[:-1] if trimmed else path + "/"})
        template = None if template is None else template.rstrip("/") + ("/" if trimmed else "")
    if UNINSTRUMENTED.search(template or path):
        return None
    return template or "none"


def _route_template(routes: Iterable[BaseRoute], scope: Scope) -> str | None:
    """The path of the first route that serves this request, else of the first that serves its path."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route.path
        if match is Match.PARTIAL and partial is None:
            partial = route.path
    return partial


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int:
    """A message's Content-Length header, 0 without one."""
    value = next((value for name, value in headers if name.lower() == b"content-length"), b"")
    return int(value) if value.isdigit() else 0


class RequestCountMiddleware:
    """Counts every HTTP response by endpoint and status code (a response that never started counts as 500), and
    records the ``http_*`` series as vLLM's instrumentation does: by route template, its duration until the
    response is complete (a stream's last event), a client gone mid-stream counted by the status sent."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        handler = handler_label(scope)  # before the app: a 401 answered before routing counts under its route
        status, response_bytes = 500, 0

        async def send_recording(message: Message) -> None:
            nonlocal status, response_bytes
            if message["type"] == "http.response.start":
                status, response_bytes = message["status"], _content_length(message.get("headers", ()))
            await send(message)

        try:
            await self.app(scope, receive, send_recording)
        finally:
            counted = CLIENT_CLOSED_REQUEST if scope.get(CLIENT_GONE) else status  # a stream's client went away
            self.metrics.requests.labels(endpoint_label(route_path(scope)), str(counted)).inc()
            if (refusal := scope.get(REFUSAL)) is not None:
                self.metrics.refused.labels(refusal).inc()
            if handler is not None:
                self.metrics.http.observe(scope, handler, status, response_bytes, time.perf_counter() - start)
