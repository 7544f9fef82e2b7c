"""vLLM's metric names (``vllm:*``, labelled ``model_name``) beside Kiln's own, so Grafana dashboards, autoscalers
(KEDA, the Kubernetes gateway's inference extension) and alerts written for vLLM read a Kiln server unchanged."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kiln.runtime.outputs import RequestOutput

# vLLM's own buckets for these histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class VllmEngineCollector:
    """The engine's state at scrape time under vLLM's names."""

    def __init__(self, model_name: str, stats: Callable[[], dict | None]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:  # the engine is still loading, or has failed
            return
        labels, value = ["model_name"], [self._model_name]

        def family(kind: type, name: str, documentation: str, number: float) -> Metric:
            metric = kind(name, documentation, labels=labels)
            metric.add_metric(value, number)
            return metric

        kv = stats["kv_cache"]
        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch",
                     stats["num_running"])
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled",
                     stats["num_waiting"])
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Share of KV-cache blocks in use (0 to 1)",
                     kv["used_blocks"] / kv["num_blocks"] if kv["num_blocks"] else 0.0)
        yield family(CounterMetricFamily, "vllm:num_preemptions", "Requests preempted", stats["num_preemptions"])
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                     stats["prefix_cache"]["queried_tokens"])
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                     stats["prefix_cache"]["hit_tokens"])


class VllmRequestMetrics:
    """Finished requests under vLLM's names: token counters, outcomes and latency histograms."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self._model_name = model_name
        labels = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", labels, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels, registry=registry)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                       [*labels, "finished_reason"], registry=registry)
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                                             buckets=TTFT_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds", "Time between two tokens", labels,
                                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e_latency = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                                     buckets=E2E_BUCKETS, registry=registry)

    def aborted(self, count: int, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        """Count requests that ended without an output (their client went away), as vLLM counts aborts, with the
        tokens they had processed: the prompts prefilled and the tokens generated before they stopped."""
        self.request_success.labels(self._model_name, "abort").inc(count)
        self.prompt_tokens.labels(self._model_name).inc(prompt_tokens)
        self.generation_tokens.labels(self._model_name).inc(generation_tokens)

    def observe(self, output: RequestOutput) -> None:
        metrics, name = output.metrics, self._model_name
        self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(name).inc(len(output.token_ids))
        self.request_success.labels(name, output.finish_reason or "abort").inc()
        if metrics.time_to_first_token is not None:
            self.time_to_first_token.labels(name).observe(metrics.time_to_first_token)
        inter_token = self.inter_token_latency.labels(name)
        for latency in metrics.inter_token_latencies:
            inter_token.observe(latency)
        if metrics.e2e_latency is not None:
            self.e2e_latency.labels(name).observe(metrics.e2e_latency)
