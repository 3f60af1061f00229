"""Worker-selection policies (one table, name -> class) and DP-rank choice by load.

A policy picks a worker among the routable candidates of one role; it may also name the DP rank (``cache_aware``
does: each rank has its own radix cache). Otherwise ``pick_rank`` chooses the rank by load. The rank is never
derived from the bootstrap room.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router import cache_tiers
from router.candidates import Candidates
from router.config import RouterConfig
from router.prefix_index import PrefixIndex, block_hashes
from router.workers import Worker


@dataclass(slots=True)
class RouteHint:
    """What the policies know about a request."""

    input_ids: Sequence[int]
    tokens: int  # prompt + max_new_tokens: the request's KV footprint and its weight in in-flight tokens
    _hashes: dict[int, list[int]] = field(default_factory=dict)

    def hashes(self, block_tokens: int, max_blocks: int | None = None) -> list[int]:
        h = self._hashes.get(block_tokens)
        if h is None:
            h = self._hashes[block_tokens] = block_hashes(self.input_ids, block_tokens, max_blocks)
        return h


class Policy:
    name = ""

    def pick(self, workers: Sequence[Worker], hint: RouteHint) -> tuple[Worker, int | None]:
        """Pick one of ``workers`` (non-empty); optionally the DP rank too."""
        raise NotImplementedError

    def routed(self, worker: Worker, rank: int, hint: RouteHint) -> None:
        """Called once the request is dispatched to (worker, rank)."""

    def forget(self, address: str) -> None:
        """The worker left the registry."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, cfg: RouterConfig, rng: random.Random) -> None:
        self.next = 0

    def pick(self, workers: Sequence[Worker], hint: RouteHint) -> tuple[Worker, int | None]:
        w = workers[self.next % len(workers)]
        self.next += 1
        return w, None


class Random(Policy):
    name = "random"

    def __init__(self, cfg: RouterConfig, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, workers: Sequence[Worker], hint: RouteHint) -> tuple[Worker, int | None]:
        return workers[self.rng.randrange(len(workers))], None


class PowerOfTwo(Policy):
    """The less loaded (router in-flight tokens, then queued requests) of two distinct random workers."""

    name = "power_of_two"

    def __init__(self, cfg: RouterConfig, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, workers: Sequence[Worker], hint: RouteHint) -> tuple[Worker, int | None]:
        if len(workers) == 1:
            return workers[0], None
        a, b = self.rng.sample(range(len(workers)), 2)
        wa, wb = workers[a], workers[b]
        return (wa if _load(wa) <= _load(wb) else wb), None


class CacheAware(Policy):
    """SGLang's cache-aware routing at DP-rank granularity.

    Imbalanced (max - min in-flight > ``balance_abs_threshold`` and max > ``balance_rel_threshold`` * min): the
    least loaded worker. Otherwise the (worker, rank) holding the longest routed prefix if it covers at least
    ``cache_threshold`` of the prompt, else the least loaded worker. Each rank's share of the index is bounded by
    the KV pool its node reports (``total_kv_pages * page_size`` tokens), so the index forgets as the node evicts.
    With a hierarchical cache the prefix is scored by the tier it likely sits in and the index keeps it as long as
    the host tier can (``router.cache_tiers``).
    """

    name = "cache_aware"

    def __init__(self, cfg: RouterConfig, rng: random.Random) -> None:
        self.cfg = cfg
        self.index = PrefixIndex(cfg.prefix_block_tokens, cfg.prefix_tree_blocks)
        self.stores: dict[str, str] = {}  # tenant -> the storage tier it reported (hierarchical cache), if any

    def pick(self, workers: Sequence[Worker], hint: RouteHint) -> tuple[Worker, int | None]:
        if len(workers) > 1:
            inflight = list(map(_INFLIGHT, workers))  # NOTE: one pass at C speed; no per-worker Python frame
            hi, lo = max(inflight), min(inflight)
            if hi - lo > self.cfg.balance_abs_threshold and hi > self.cfg.balance_rel_threshold * lo:
                return _least(workers), None
        hashes = hint.hashes(self.index.block_tokens, self.index.max_blocks)
        # NOTE: cost per request ~ the matched depth, plus one pass over the workers only when nothing matched.
        matched = self.index.match(hashes) if hashes else {}
        if matched:
            by_address = workers.by_address() if isinstance(workers, Candidates) else {w.address: w for w in workers}
            best: tuple[float, int] = (0.0, 0)
            choice: tuple[Worker, int] | None = None
            for tenant, m in matched.items():
                address, _, rank = tenant.rpartition("#")
                w = by_address.get(address)
                if w is None or int(rank) >= len(w.ranks):
                    continue
                score = cache_tiers.tiered_depth(self.index, tenant, hashes, m, w, int(rank))
                key = (score, -w.ranks[int(rank)].queued())
                if choice is None or key > best:
                    best, choice = key, (w, int(rank))
            stored = cache_tiers.stored_depths(matched, self.stores) if self.stores else {}
            for w, rank, score in cache_tiers.storage_candidates(workers, stored) if stored else ():
                key = (score, -w.ranks[rank].queued())
                if key > best:
                    best, choice = key, (w, rank)
            if choice is not None and best[0] / len(hashes) >= self.cfg.cache_threshold:
                return choice
        return _least(workers), None

    def routed(self, worker: Worker, rank: int, hint: RouteHint) -> None:
        hashes = hint.hashes(self.index.block_tokens, self.index.max_blocks)
        if not hashes:
            return
        tenant = _tenant(worker, rank)
        capacity = cache_tiers.index_capacity(worker, rank)  # the device pool, and a hierarchical cache's host tier
        if capacity is not None:
            self.index.set_capacity(tenant, capacity)
        if store := cache_tiers.store_of(worker, rank):
            self.stores[tenant] = store
        self.index.insert(tenant, hashes)

    def forget(self, address: str) -> None:
        self.index.remove_tenant_prefix(address + "#")
        for tenant in [t for t in self.stores if t.startswith(address + "#")]:
            del self.stores[tenant]


POLICY_TABLE: dict[str, Callable[[RouterConfig, random.Random], Policy]] = {
    "round_robin": RoundRobin,
    "random": Random,
    "power_of_two": PowerOfTwo,
    "cache_aware": CacheAware,
}


def make_policy(name: str, cfg: RouterConfig, rng: random.Random | None = None) -> Policy:
    return POLICY_TABLE[name](cfg, rng or random.Random())


def pick_rank(worker: Worker, need_pages: int | None) -> int:
    """The DP rank with the least queued work among those whose free KV pages can hold ``need_pages``.

    Falls back to ranks that cannot hold it (the node queues the request) only when none can. Ties rotate.
    """
    ranks = worker.ranks
    n = len(ranks)
    if n == 1:
        return 0
    start = worker.rr
    worker.rr += 1
    best_key: tuple[bool, int, int] | None = None
    best = 0
    for i in range(n):
        s = ranks[(start + i) % n]
        free = s.free_pages(worker.page_size)
        fits = free is None or need_pages is None or free >= need_pages
        key = (not fits, s.queued(), s.inflight_tokens)
        if best_key is None or key < best_key:
            best_key, best = key, s.rank
    return best


def _least(workers: Sequence[Worker]) -> Worker:
    """The worker with the fewest in-flight tokens, ties broken by queued requests (``min(workers, key=_load)``)."""
    tokens = list(map(_INFLIGHT_TOKENS, workers))  # NOTE: C-speed passes; Python frames only for ties
    lo = min(tokens)
    if tokens.count(lo) == 1:
        return workers[tokens.index(lo)]
    return min((w for w, t in zip(workers, tokens, strict=True) if t == lo), key=_load)


_INFLIGHT = operator.attrgetter("inflight")
_INFLIGHT_TOKENS = operator.attrgetter("inflight_tokens")


def _load(w: Worker) -> tuple[int, int]:
    return w.inflight_tokens, sum(s.queued() for s in w.ranks)


def _tenant(w: Worker, rank: int) -> str:
    return f"{w.address}#{rank}"
