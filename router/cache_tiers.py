"""Tier-aware scores for the ``cache_aware`` policy: where a routed prefix likely sits on a node with a hierarchical
cache (``--enable-hierarchical-cache``), from what the node reports (``RankLoad.host_cache_tokens``,
``RankLoad.cache_storage``) and the prefix index's routing ages.

    device    the newest ``total_kv_pages * page_size`` tokens routed to a rank (the device evicts oldest first)
    host      older ones, up to the host tier's size more: the index keeps them that much longer for such a rank
    storage   a prefix routed to any rank of the same store is stored for every rank of that store

A matched block scores 1 on the device, ``HOST_WEIGHT`` on the host (a load away) and ``STORAGE_WEIGHT`` in the store
(a read and a load away): the order of their costs, all below a recompute (0). A rank without those tiers scores
its matched blocks 1 each, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from router.prefix_index import PrefixIndex
from router.workers import Worker

HOST_WEIGHT = 0.75
STORAGE_WEIGHT = 0.5


def index_capacity(worker: Worker, rank: int) -> int | None:
    """Tokens the index keeps for (worker, rank): its device pool and host tier (None: no report yet)."""
    report = worker.ranks[rank].report if rank < len(worker.ranks) else None
    if report is None or report.total_kv_pages <= 0:
        return None
    return report.total_kv_pages * worker.page_size + report.host_cache_tokens


def tiered_depth(index: PrefixIndex, tenant: str, hashes: Sequence[int], depth: int, worker: Worker,
                 rank: int) -> float:
    """The score of ``tenant``'s ``depth`` matched leading blocks of ``hashes``."""
    report = worker.ranks[rank].report
    if report is None or not report.host_cache_tokens:
        return float(depth)
    device_blocks = report.total_kv_pages * worker.page_size // index.block_tokens
    on_device = 0
    while on_device < depth and index.age(tenant, hashes[on_device]) < device_blocks:
        on_device += 1
    return on_device + HOST_WEIGHT * (depth - on_device)


def store_of(worker: Worker, rank: int) -> str:
    report = worker.ranks[rank].report if rank < len(worker.ranks) else None
    return report.cache_storage if report is not None else ""


def stored_depths(matched: dict[str, int], stores: dict[str, str]) -> dict[str, int]:
    """Per store: the longest matched prefix routed to any rank on it (``stores``: tenant -> its store, for every
    tenant routed to while it reported one; the holder need not be a candidate now)."""
    out: dict[str, int] = {}
    for tenant, depth in matched.items():
        store = stores.get(tenant)
        if store:
            out[store] = max(out.get(store, 0), depth)
    return out


def storage_candidates(workers: Iterable[Worker], stored: dict[str, int]) -> Iterable[tuple[Worker, int, float]]:
    """(worker, rank, score) of every rank on a store holding a matched prefix."""
    for w in workers:
        for state in w.ranks:
            report = state.report
            depth = stored.get(report.cache_storage, 0) if report is not None and report.cache_storage else 0
            if depth:
                yield w, state.rank, STORAGE_WEIGHT * depth
