"""The cache-aware policy's prefix index: bounded by each node's KV pool, evicting as the node's radix cache would
(least recently used first, a path's leaves before its root), consistent after any mix of operations, and cheap
enough per request with 64 tenants that routing never stalls the router's event loop."""

from __future__ import annotations

import collections
import random
import time
import tracemalloc

from pdcluster.v1 import worker_pb2
from router.config import RouterConfig, WorkerSpec
from router.fleet.worker import Lease, Worker
from router.routing.policies import RouteHint, make_policy
from router.routing.prefix_index import PrefixIndex, block_hashes

CFG = RouterConfig(workers=(), prefix_block_tokens=16)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(n)]


def _consistent(idx: PrefixIndex) -> None:
    for tenant, lru in idx.lru.items():
        bit = 1 << idx.slot[tenant]
        assert all(idx.holders[h] & bit for h in lru)
        assert len(lru) <= idx.capacity.get(tenant, idx.max_blocks)
    for h, mask in idx.holders.items():
        assert mask
        for slot in range(mask.bit_length()):
            if mask >> slot & 1:
                assert h in idx.lru[idx.by_slot[slot]]


def test_capacity_follows_the_node_pool_and_shrinking_evicts() -> None:
    idx = PrefixIndex(block_tokens=16, max_blocks=1000)
    idx.set_capacity("n#0", 64 * 16)
    for g in range(10):
        idx.insert("n#0", block_hashes(_ids(g, 320), 16))  # 20 blocks each, 200 in all
    assert idx.size("n#0") == 64 and idx.blocks() == 64
    idx.set_capacity("n#0", 10 * 16 + 15)  # whole blocks only
    assert idx.size("n#0") == 10
    idx.set_capacity("n#0", 10**9)
    assert idx.capacity["n#0"] == 1000  # max_blocks caps what any node reports
    _consistent(idx)


def test_evicts_leaves_before_their_root_and_keeps_a_hot_prefix() -> None:
    idx = PrefixIndex(block_tokens=4, max_blocks=12)
    hot = _ids(1, 16)  # 4 blocks, reused by every request of its group
    for i in range(20):
        idx.insert("t", block_hashes(hot + _ids(100 + i, 16), 4))  # 8 blocks: the prefix and a unique tail
        assert idx.match(block_hashes(hot, 4)) == {"t": 4}
    cold = block_hashes(_ids(2, 32), 4)
    idx.insert("t", cold)
    idx.insert("t", block_hashes(hot + _ids(999, 16), 4))
    # the older path lost its tail first: its head still matches
    assert idx.match(cold) == {"t": 4} and idx.size("t") == 12
    _consistent(idx)


def test_match_reports_each_tenants_depth_and_removal_frees_its_slot() -> None:
    idx = PrefixIndex(block_tokens=4, max_blocks=100)
    p = _ids(3, 40)
    idx.insert("a", block_hashes(p[:12], 4))
    idx.insert("b", block_hashes(p, 4))
    idx.insert("c", block_hashes(_ids(4, 40), 4))
    assert idx.match(block_hashes(p, 4)) == {"a": 3, "b": 10}
    idx.remove_tenant_prefix("b")
    idx.insert("d", block_hashes(_ids(5, 8), 4))  # reuses b's slot: b's blocks must not show up as d's
    assert idx.match(block_hashes(p, 4)) == {"a": 3}
    _consistent(idx)


def test_random_operations_keep_the_index_consistent() -> None:
    rng = random.Random(7)
    idx = PrefixIndex(block_tokens=4, max_blocks=30)
    prefixes = [_ids(10 + g, 24) for g in range(5)]
    for step in range(400):
        t = f"w{rng.randrange(6)}#0"
        op = rng.random()
        if op < 0.8:
            idx.insert(t, block_hashes(rng.choice(prefixes) + _ids(step, rng.randrange(0, 40)), 4))
        elif op < 0.9:
            idx.set_capacity(t, rng.randrange(1, 200))
        else:
            idx.remove_tenant(t)
    _consistent(idx)


def _worker(i: int, total_kv_pages: int, page_size: int = 16) -> Worker:
    w = Worker(WorkerSpec(role="prefill", address=f"127.0.0.1:{20000 + i}", bootstrap_port=9), CFG)
    w.set_info(worker_pb2.ServerInfo(mode="prefill", page_size=page_size, dp_size=1, bootstrap_port=9))
    w.healthy = True
    w.admit()
    w.set_load(worker_pb2.GetLoadResponse(ranks=[worker_pb2.RankLoad(dp_rank=0, total_kv_pages=total_kv_pages,
                                                                      free_kv_pages=total_kv_pages)],
                                          page_size=page_size))
    return w


async def test_policy_bounds_each_worker_by_its_reported_kv_pool() -> None:
    small, big = _worker(0, total_kv_pages=8), _worker(1, total_kv_pages=10**6)  # 128 tokens, 16 M tokens
    ca = make_policy("cache_aware", CFG)
    for g in range(40):
        h = RouteHint(_ids(g, 512), 520)
        ca.routed(small, 0, h)
        ca.routed(big, 0, h)
    idx = ca.index  # type: ignore[attr-defined]
    assert idx.size(f"{small.address}#0") == 128 // 16
    assert idx.size(f"{big.address}#0") == 40 * 32  # under CFG.prefix_tree_blocks, so all kept
    ca.forget(big.address)
    assert idx.blocks() == 8


async def test_routing_with_64_workers_costs_little_per_request() -> None:
    """Shared-prefix traffic over 64 prefill workers, each with a 64k-token pool: pick + routed per request, and
    the index's memory per held block (figures printed; the budget is far above what a quiet core needs)."""
    workers = [_worker(i, total_kv_pages=4096) for i in range(64)]
    ca = make_policy("cache_aware", CFG)
    prefixes = [_ids(g, 512) for g in range(128)]
    rng = random.Random(0)
    hints = [RouteHint(rng.choice(prefixes) + _ids(10**5 + i, 128), 700) for i in range(3000)]
    inflight: collections.deque[Lease] = collections.deque(maxlen=None)
    idx = ca.index  # type: ignore[attr-defined]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    n, cost = 0, 0.0
    for i, hint in enumerate(hints):
        if i == 1000:  # the index is warm: every prefix has been routed; time from here, without tracemalloc
            mem = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            bytes_per_block = mem / sum(len(lru) for lru in idx.lru.values())
        t0 = time.perf_counter()
        w, rank = ca.pick(workers, hint)
        ca.routed(w, rank or 0, hint)
        dt = time.perf_counter() - t0
        inflight.append(Lease(w, w.ranks[rank or 0], hint.tokens, 0))
        if len(inflight) > 64:  # 64 requests in flight: the least loaded worker changes
            inflight.popleft().release()
        if i >= 1000:
            n, cost = n + 1, cost + dt
    for lease in inflight:
        lease.release()
    held = sum(len(lru) for lru in idx.lru.values())
    assert len(idx.lru) > 32  # the traffic spread
    per_request_us = cost / n * 1e6
    print(f"\n64 workers: {per_request_us:.0f} us per request (pick + routed, 640-token prompts); "
          f"{held} held blocks, {idx.blocks()} distinct, {bytes_per_block:.0f} B per held block")
    assert held <= 64 * 4096 * 16 // 16
    assert per_request_us < 2000, per_request_us
    assert bytes_per_block < 400
