"""A Prometheus histogram that takes a request's observations at once: its per-token latencies are sorted once and
binned with a bisect per bucket, instead of one ``Histogram.observe`` per token on the server's event loop."""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import INF, floatToGoString


@dataclass(frozen=True)
class Observations:
    """Values sorted ascending, with their sum: sorted once, binned by as many histograms as read them."""

    ordered: list[float]
    total: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Observations:
        ordered = sorted(values)
        return cls(ordered, sum(ordered))


class BinnedHistogram:
    """A histogram whose exposition is prometheus-client's ``Histogram``'s, byte for byte (buckets with ``le``, then
    ``_count``, ``_sum`` and ``_created``), for one series with fixed label values (none, or e.g. vLLM's
    ``model_name`` and ``engine``). A value counts in every bucket whose bound it does not exceed, as there."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry,
                 labels: dict[str, str] | None = None) -> None:
        labels = labels or {}
        bounds = [float(bound) for bound in buckets]
        self._name = name
        self._documentation = documentation
        self._bounds = bounds if bounds[-1] == INF else [*bounds, INF]
        self._les = [floatToGoString(bound) for bound in self._bounds]
        self._labels = labels
        self._cumulative = [0] * len(self._bounds)  # observations at or below each bound
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, observations: Observations) -> None:
        """Count a batch of observations: one bisect per bucket, whatever the batch's size."""
        ordered = observations.ordered
        with self._lock:  # a new list, so a scrape reads the one it took whole
            self._cumulative = [count + bisect_right(ordered, bound)
                                for count, bound in zip(self._cumulative, self._bounds, strict=True)]
            self._sum += observations.total

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cumulative, total = self._cumulative, self._sum
        metric = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        buckets = [(le, float(count)) for le, count in zip(self._les, cumulative, strict=True)]
        metric.add_metric(list(self._labels.values()), buckets, total)
        # PROMETHEUS_DISABLE_CREATED_SERIES as prometheus-client's own histograms read it (its private flag; a
        # release without it keeps the series, its default)
        if getattr(prometheus_metrics, "_use_created", True):
            metric.add_sample(f"{self._name}_created", self._labels, self._created)
        yield metric
