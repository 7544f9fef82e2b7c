"""Prometheus metrics: server counters and latency histograms, plus engine gauges read from `llm.stats()` per scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.runtime.outputs import RequestOutput
from kiln.runtime.server.binned_histogram import BinnedHistogram, Observations
from kiln.runtime.server.vllm_metrics import VllmEngineCollector, VllmRequestMetrics, reported

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away before the response
CLIENT_GONE = "kiln.client_gone"  # set in the ASGI scope when a streamed response's client went away mid-stream
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/invocations", "/tokenize",
             "/detokenize", "/tokenizer_info", "/health", "/ping", "/metrics", "/version")


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


class ServerMetrics:
    """One registry per app, so several apps (tests, embedders) never collide in prometheus-client's global one.
    ``engine_pid`` gives the engine process's id when the engine runs in one (else None). Kiln's ``kiln_*``
    metrics, and vLLM's names for the same (``vllm:*``, labelled with ``model_name``)."""

    def __init__(self, stats: Callable[[], dict | None], engine_cache: Callable[[], dict],
                 engine_pid: Callable[[], int | None], model_name: str) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        _EngineProcessCollector(engine_pid, self.registry)
        self.requests = Counter("kiln_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
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

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def endpoint_label(path: str) -> str:
    """A bounded label for a request path (unknown paths share one label, so scanners cannot blow up cardinality)."""
    if path in ENDPOINTS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class RequestCountMiddleware:
    """Counts every HTTP response by endpoint and status code (a response that never started counts as 500)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_recording)
        finally:
            status = CLIENT_CLOSED_REQUEST if scope.get(CLIENT_GONE) else status  # a stream's client went away
            self.metrics.requests.labels(endpoint_label(scope["path"]), str(status)).inc()
