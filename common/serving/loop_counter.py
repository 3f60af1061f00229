"""``LoopCounter``: a Prometheus counter cheap enough to bump several times per request on an event loop."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class LoopCounter(Collector):
    """A Prometheus counter updated from one thread only (the router's event loop): ``labels`` is a dict lookup
    and ``inc`` an attribute add, without ``prometheus_client.Counter``'s label validation, lock and checks per
    call; exported as an ordinary counter (``_total`` and ``_created`` per series) at each scrape.
    ``name`` is the counter's name without ``_total``."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._children: dict[tuple[str, ...], CounterChild] = {}
        self._own = CounterChild()  # the series of a counter without labels
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> CounterChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {values!r}")
            child = self._children[values] = CounterChild()
        return child

    def inc(self, amount: float = 1) -> None:
        self._own.value += amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        series = self._children.items() if self.labelnames else [((), self._own)]
        for values, child in series:
            family.add_metric([str(v) for v in values], child.value, created=child.created)
        yield family
