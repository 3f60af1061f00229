"""Prometheus metrics of a node's front process (seconds and bytes; names ``pdcluster_node_*``).

Queue gauges come from the ranks' periodic load reports; latency, transfer and failure metrics from the final
message of each request (its timing breakdown and error code).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from common.engine.io_struct import PrefillDone, QueueLoad, TokenOut
from common.errors import ErrorCode
from common.node.hicache_metrics import observe_hicache
from common.serving.gap_histogram import GapHistogram
from common.speculative import accept_length

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(1, 12))
QUEUES = ("waiting", "running", "bootstrap", "inflight", "prealloc", "transfer")

QUEUE_LEN = Gauge("pdcluster_node_queue_requests", "Requests per queue and DP rank", ["queue", "dp_rank"])
QUEUE_BY_PRIORITY = Gauge("pdcluster_node_queue_requests_by_priority",
                          "Requests per queue, priority class ('none': sent without a priority) and DP rank",
                          ["queue", "priority", "dp_rank"])
PREEMPTIONS = Counter("pdcluster_node_priority_preemptions_total",
                      "Running requests retracted for a more urgent waiting one (priority scheduling)", ["dp_rank"])
TOKEN_USAGE = Gauge("pdcluster_node_token_usage_ratio", "Fraction of KV slots in use", ["dp_rank"])
FREE_PAGES = Gauge("pdcluster_node_free_kv_pages", "Free KV pages", ["dp_rank"])
TTFT = Histogram("pdcluster_node_ttft_seconds", "Arrival to first token on this node", buckets=LATENCY_BUCKETS)
E2E = Histogram("pdcluster_node_e2e_seconds", "Arrival to finish on this node", buckets=LATENCY_BUCKETS)
TPOT = Histogram("pdcluster_node_tpot_seconds", "Per request: (e2e - ttft) / (output tokens - 1)",
                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28))
ITL = GapHistogram("pdcluster_node_itl_seconds",  # observed per token, on the front's event loop only
                   "Gap between consecutive token chunks of a request, per token", LATENCY_BUCKETS, REGISTRY)
QUEUE_TIME = Histogram("pdcluster_node_queue_seconds", "Time waiting for a prefill batch", buckets=LATENCY_BUCKETS)
TRANSFER_TIME = Histogram("pdcluster_node_kv_transfer_seconds", "KV transfer latency of one request",
                          buckets=LATENCY_BUCKETS)
TRANSFER_BYTES = Histogram("pdcluster_node_kv_transfer_bytes", "KV bytes moved for one request",
                           buckets=BYTES_BUCKETS)
TRANSFER_BANDWIDTH = Histogram("pdcluster_node_kv_transfer_bandwidth_bytes_per_second",
                               "KV bytes over transfer time of one request",
                               buckets=tuple(float(10**i) for i in range(5, 12)))
SPEC_ACCEPT_LENGTH = Histogram("pdcluster_node_spec_accept_length", "Speculative decoding, per request: tokens "
                               "emitted per verify step (1 + accepted drafts / verify steps)",
                               buckets=(1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 16.0))
SPEC_DRAFT_TOKENS = Counter("pdcluster_node_spec_draft_tokens_total", "Speculative decoding: draft tokens proposed")
SPEC_ACCEPTED_TOKENS = Counter("pdcluster_node_spec_accepted_tokens_total",
                               "Speculative decoding: draft tokens accepted (emitted)")
SPEC_VERIFY_STEPS = Counter("pdcluster_node_spec_verify_steps_total",
                            "Speculative decoding: (request, verify step) pairs that checked drafts")
REQUESTS = Counter("pdcluster_node_requests_total", "Finished requests by outcome", ["outcome"])
FAILURES = Counter("pdcluster_node_failures_total", "Failed requests by kind (bootstrap, transfer, ...)",
                   ["kind", "code"])
REQUESTS.labels(outcome="ok")
for _kind in ("bootstrap", "transfer"):
    FAILURES.labels(kind=_kind, code=ErrorCode.UNAVAILABLE)  # exported at 0 from the start


def observe_itl(gap_s: float, num_tokens: int) -> None:
    """A streamed chunk of ``num_tokens`` arrived ``gap_s`` after the request's previous one."""
    if num_tokens > 0:
        per_token = gap_s / num_tokens
        for _ in range(num_tokens):
            ITL.observe(per_token)


def observe_final(out: Any) -> None:
    """Record one request's final message (``TokenOut`` with finish_reason, or ``PrefillDone``)."""
    if isinstance(out, TokenOut | PrefillDone):
        code = out.error_code
        REQUESTS.labels(outcome="ok" if code is None else code.lower()).inc()
        if code is not None and code != ErrorCode.CANCELLED:
            kind = "bootstrap" if "bootstrap" in (out.error or "").lower() else "transfer"
            FAILURES.labels(kind=kind if code != ErrorCode.INVALID_ARGUMENT else "invalid", code=code).inc()
        if isinstance(out, TokenOut) and out.spec_verify_ct:
            SPEC_ACCEPT_LENGTH.observe(accept_length(out.spec_verify_ct, out.spec_accepted_tokens))
            SPEC_DRAFT_TOKENS.inc(out.spec_draft_tokens)
            SPEC_ACCEPTED_TOKENS.inc(out.spec_accepted_tokens)
            SPEC_VERIFY_STEPS.inc(out.spec_verify_ct)
        t = out.timing
        if t is None:
            return
        if t.ttft:
            TTFT.observe(t.ttft)
        if t.e2e:
            E2E.observe(t.e2e)
            n = getattr(out, "completion_tokens", 0)
            if n > 1 and t.ttft:
                TPOT.observe((t.e2e - t.ttft) / (n - 1))
        if t.queue:
            QUEUE_TIME.observe(t.queue)
        if t.transfer_bytes:
            TRANSFER_BYTES.observe(t.transfer_bytes)
            if t.transfer > 0:
                TRANSFER_TIME.observe(t.transfer)
                TRANSFER_BANDWIDTH.observe(t.transfer_bytes / t.transfer)


_priority_labels: dict[str, set[tuple[str, str]]] = {}  # per DP rank: the (queue, priority) gauges set so far
_preemptions_seen: dict[str, int] = {}  # per DP rank: the rank's cumulative count at its last report


def observe_priorities(q: QueueLoad) -> None:
    """Per-priority queue gauges (a class that emptied goes to 0) and the preemption counter (from the rank's
    cumulative count; a restarted rank starts again from 0)."""
    rank = str(q.dp_rank)
    now = {(queue, prio): n for queue, by_prio in q.queue_by_priority.items() for prio, n in by_prio.items()}
    for queue, prio in _priority_labels.get(rank, set()) - now.keys():
        QUEUE_BY_PRIORITY.labels(queue=queue, priority=prio, dp_rank=rank).set(0)
    for (queue, prio), n in now.items():
        QUEUE_BY_PRIORITY.labels(queue=queue, priority=prio, dp_rank=rank).set(n)
    _priority_labels[rank] = _priority_labels.get(rank, set()) | now.keys()
    seen = _preemptions_seen.get(rank, 0)
    PREEMPTIONS.labels(dp_rank=rank).inc(q.preemptions - seen if q.preemptions >= seen else q.preemptions)
    _preemptions_seen[rank] = q.preemptions


def observe_load(loads: list[QueueLoad]) -> None:
    for q in loads:
        rank = str(q.dp_rank)
        observe_priorities(q)
        for name in QUEUES:
            QUEUE_LEN.labels(queue=name, dp_rank=rank).set(getattr(q, name))
        TOKEN_USAGE.labels(dp_rank=rank).set(q.token_usage)
        FREE_PAGES.labels(dp_rank=rank).set(q.free_kv_pages)
        if q.hicache is not None:
            observe_hicache(q.dp_rank, q.hicache)


async def poll_load_forever(ranks: Any, interval: float = 1.0) -> None:
    while True:
        await asyncio.sleep(interval)
        with contextlib.suppress(TimeoutError):
            observe_load(await ranks.get_load(timeout=interval * 2))
