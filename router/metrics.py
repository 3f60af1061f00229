"""Router Prometheus metrics: one ``CollectorRegistry`` per router instance (tests run several in one process).

Names: ``pdcluster_router_<what>_<unit>``; latencies in seconds, counters end in ``_total``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.serving.gap_histogram import GapHistogram
from common.serving.loop_counter import LoopCounter
from router.tokenize_cache import TokenizerCache

# Latency buckets from 1 ms to 2 min; ITL buckets finer at the low end.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
OUTCOMES = ("success", "invalid", "unavailable", "deadline", "cancelled", "overloaded", "error")


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "pdcluster_router_"
        # NOTE: what every request updates is a ``LoopCounter`` or ``GapHistogram`` (the event loop only; several
        # updates per request at a few hundred nanoseconds each); the rest are prometheus_client's own.
        self.requests = LoopCounter(p + "requests", "Requests by API and outcome", ("api", "outcome"), r)
        self.ttft = GapHistogram(p + "ttft_seconds", "Arrival to first token at the router", LATENCY_BUCKETS, r)
        self.itl = GapHistogram(
            p + "itl_seconds", "Gap between token chunks arriving from the decode leg", ITL_BUCKETS, r
        )
        self.e2e = GapHistogram(p + "e2e_seconds", "Arrival to the final response", LATENCY_BUCKETS, r)
        self.retries = Counter(
            p + "retries", "Attempts retried before the first token, by failed leg", ["leg"], registry=r
        )
        self.migrations = Counter(
            p + "migrations",
            "Requests moved to another worker after their leg failed having produced tokens, by failed leg",
            ["leg"],
            registry=r,
        )
        self.aborts = Counter(p + "aborts", "Worker.Abort calls sent, by worker role", ["role"], registry=r)
        # NOTE: one series per worker and role, never per (prefill, decode) pair: pairs grow as N^2 (4,096 series
        # at 64 workers a side), which a Prometheus scrape of every router replica pays for.
        self.dispatches = LoopCounter(
            p + "dispatches",
            "Requests dispatched to each worker, by the role it served them in (prefill, decode, colocated)",
            ("worker", "role"),
            r,
        )
        self.inflight = Gauge(p + "inflight_requests", "Requests in flight through the router", registry=r)
        self.prompt_tokens = LoopCounter(p + "prompt_tokens", "Prompt tokens of finished requests", (), r)
        self.completion_tokens = LoopCounter(p + "completion_tokens", "Tokens generated", (), r)
        self.cached_tokens = LoopCounter(p + "cached_tokens", "Prompt tokens served from a prefix cache", (), r)
        self.worker_healthy = Gauge(
            p + "worker_healthy", "1 when the worker passes health checks", ["worker", "role"], registry=r
        )
        self.worker_circuit_open = Gauge(
            p + "worker_circuit_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open",
            ["worker"],
            registry=r,
        )
        self.worker_inflight = Gauge(
            p + "worker_inflight_requests", "Router requests in flight per worker", ["worker"], registry=r
        )
        self.worker_rejections = Counter(
            p + "worker_rejections",
            "Workers found unusable: failed membership proofs (wrong_proof, refused) and absurd or disagreeing "
            "reported facts (info, load), by role",
            ["role", "reason"],
            registry=r,
        )
        for leg in ("prefill", "decode", "generate", "overloaded"):
            self.retries.labels(leg)
        for role in ("prefill", "decode", "colocated"):
            self.aborts.labels(role)
        for outcome in OUTCOMES:
            for api in ("grpc", "completions", "chat"):
                self.requests.labels(api, outcome)

    def watch_tokenizer_cache(self, cache: TokenizerCache) -> None:
        """Export the router process's tokenizer cache (its counts are read at each scrape)."""
        self.registry.register(_TokenizerCacheCollector(cache))

    def render(self) -> bytes:
        return generate_latest(self.registry)



class _TokenizerCacheCollector(Collector):
    def __init__(self, cache: TokenizerCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        c, p = self.cache, "pdcluster_router_tokenizer_cache_"
        lookups = CounterMetricFamily(p + "lookups", "Tokenizer cache lookups in the router process, by level "
                                      "(L0: whole prompts; L1: prompt pieces) and result", labels=("level", "result"))
        for level, hits, misses in (("l0", c.l0_hits, c.l0_misses), ("l1", c.l1_hits, c.l1_misses)):
            lookups.add_metric([level, "hit"], hits)
            lookups.add_metric([level, "miss"], misses)
        yield lookups
        entries = GaugeMetricFamily(p + "entries", "Entries in the router process's tokenizer cache, by level",
                                    labels=("level",))
        entries.add_metric(["l0"], c.l0_entries)
        entries.add_metric(["l1"], c.l1_entries)
        yield entries
        yield GaugeMetricFamily(p + "l1_bytes", "Bytes held by the router process's L1 tokenizer cache",
                                value=c.l1_bytes)
