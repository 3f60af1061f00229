"""``cache_aware`` with hierarchical caches (``router.cache_tiers``): a rank's host tier keeps its routed prefixes
in the index longer, a prefix is scored by the tier it likely sits in (device > host > a shared store), and a store
shared by ranks makes a prefix routed to one a hit on the others."""

from __future__ import annotations

from pdcluster.v1 import worker_pb2
from router.policies import RouteHint, make_policy
from tests.router.test_router_units import CFG, worker

BLOCK = 4  # CFG.prefix_block_tokens; the workers' page size is 4 too
P = list(range(100, 132))  # 8 blocks


def report(w, device_pages: int, host_tokens: int = 0, store: str = "") -> None:
    w.set_load(worker_pb2.GetLoadResponse(page_size=4, ranks=[worker_pb2.RankLoad(
        dp_rank=0, free_kv_pages=device_pages, total_kv_pages=device_pages, host_cache_tokens=host_tokens,
        cache_storage=store)]))


def other(i: int) -> list[int]:
    return list(range(1000 * i, 1000 * i + 32))


async def test_a_host_tier_keeps_a_prefix_routable_and_scores_it_below_the_device() -> None:
    host, plain = worker(1), worker(2)
    report(host, device_pages=8, host_tokens=128)  # 8 blocks on the device, 32 more on the host
    report(plain, device_pages=8)
    ca = make_policy("cache_aware", CFG)
    for ids in (P, other(1)):  # P ends older than the device holds: on the host
        ca.routed(host, 0, RouteHint(ids, 40))
    ca.routed(plain, 0, RouteHint(other(2), 40))
    assert ca.pick([host, plain], RouteHint(P, 40)) == (host, 0)  # kept: 16 blocks fit device + host
    ca.routed(plain, 0, RouteHint(P[:28], 40))  # 7 blocks, newest on plain's device: 7 > 8 * HOST_WEIGHT
    assert ca.pick([host, plain], RouteHint(P, 40)) == (plain, 0)
    ca.routed(plain, 0, RouteHint(other(3), 40))  # plain's device pool drops P's blocks (no host tier)
    ca.routed(plain, 0, RouteHint(P[:20], 40))  # 5 blocks there now: 5 < 6 on host's host tier
    assert ca.pick([host, plain], RouteHint(P, 40)) == (host, 0)


async def test_a_shared_store_makes_a_prefix_a_hit_on_every_rank_of_it() -> None:
    a, b, c = worker(1), worker(2), worker(3)
    report(a, device_pages=64, host_tokens=64, store="file:/shared")
    report(b, device_pages=64, host_tokens=64, store="file:/shared")
    report(c, device_pages=64)
    ca = make_policy("cache_aware", CFG)
    ca.routed(a, 0, RouteHint(P, 40))
    assert ca.pick([b, c], RouteHint(P, 40)) == (b, 0)  # a is not a candidate; b reads P from the store
    ca.forget(a.address)
    assert ca.pick([b, c], RouteHint(P, 40))[1] is None  # forgotten: no match, least loaded
