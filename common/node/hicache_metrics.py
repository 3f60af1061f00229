"""Prometheus metrics of the ranks' hierarchical caches (``--enable-hierarchical-cache``), from their load reports
(``QueueLoad.hicache``: running totals since the rank started; a restarted rank starts again from 0).

    pdcluster_node_hicache_hit_tokens_total{tier}        cached prompt tokens by the tier that served them
    pdcluster_node_hicache_{load,write}_bytes_total      host -> device loads, device -> host writes
    pdcluster_node_hicache_{load,write}_seconds_total    time those copies took (bytes / seconds: bandwidth)
    pdcluster_node_hicache_{load,write}_bandwidth_bytes_per_second   the same, over the rank's life
    pdcluster_node_hicache_storage_{read,write}_bytes_total
    pdcluster_node_hicache_storage_dropped_pages_total   pages not written behind (the store's queue was full)
    pdcluster_node_hicache_host_evicted_tokens_total
    pdcluster_node_hicache_timeouts_total                loads and prefetches given up at --hicache-load-timeout
    pdcluster_node_hicache_host_tokens{state=used|total}  host pool occupancy
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from common.engine.io_struct import HiCacheLoad

HIT_TOKENS = Counter("pdcluster_node_hicache_hit_tokens_total", "Cached prompt tokens by the tier that served them "
                     "(device, host, storage)", ["tier", "dp_rank"])
COUNTERS = {
    name: Counter(f"pdcluster_node_hicache_{name}_total", text, ["dp_rank"])
    for name, text in (
        ("load_bytes", "KV bytes loaded from the host tier to the device"),
        ("load_seconds", "Seconds spent on host -> device loads"),
        ("write_bytes", "KV bytes written from the device to the host tier"),
        ("write_seconds", "Seconds spent on device -> host writes"),
        ("storage_read_bytes", "KV bytes read from the storage tier"),
        ("storage_write_bytes", "KV bytes written to the storage tier"),
        ("storage_dropped_pages", "KV pages not written to the storage tier: its write queue was full"),
        ("host_evicted_tokens", "Tokens the host tier evicted (least recently used first)"),
        ("timeouts", "Host loads and storage prefetches given up at --hicache-load-timeout (their requests computed "
                     "the prefix instead)"),
    )
}
BANDWIDTH = Gauge("pdcluster_node_hicache_bandwidth_bytes_per_second", "Mean bandwidth of the host tier's copies "
                  "since the rank started", ["direction", "dp_rank"])
HOST_TOKENS = Gauge("pdcluster_node_hicache_host_tokens", "Host pool tokens (used, total)", ["state", "dp_rank"])

_seen: dict[tuple[str, str], float] = {}  # (metric, dp rank) -> the rank's running total at its last report


def _advance(counter: Counter, key: str, rank: str, total: float, **labels: str) -> None:
    last = _seen.get((key, rank), 0)
    counter.labels(dp_rank=rank, **labels).inc(total - last if total >= last else total)
    _seen[(key, rank)] = total


def observe_hicache(dp_rank: int, h: HiCacheLoad) -> None:
    rank = str(dp_rank)
    for tier, tokens in h.hit_tokens.items():
        _advance(HIT_TOKENS, f"hit_{tier}", rank, tokens, tier=tier)
    for name, counter in COUNTERS.items():
        _advance(counter, name, rank, getattr(h, name))
    for direction in ("load", "write"):
        seconds = getattr(h, f"{direction}_seconds")
        if seconds > 0:
            BANDWIDTH.labels(direction=direction, dp_rank=rank).set(getattr(h, f"{direction}_bytes") / seconds)
    HOST_TOKENS.labels(state="used", dp_rank=rank).set(h.host_tokens_used)
    HOST_TOKENS.labels(state="total", dp_rank=rank).set(h.host_tokens_total)
