"""``GapHistogram``: a Prometheus histogram cheap enough to observe once per streamed token."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class GapHistogram(Collector):
    """A Prometheus histogram for one observation per streamed token: ``observe`` is a bisect and a list
    increment, without ``prometheus_client.Histogram``'s lock and per-bucket Python loop. Observed from one thread
    only (an event loop's: the router's requests, a node front's streams); exported as an ordinary histogram at
    each scrape."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket (not cumulative); the last is +Inf
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            cumulative.append((bound, total))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=cumulative, sum_value=self.sum)
