"""Router building blocks with deterministic fakes: policies, DP-rank choice, rooms, circuit breaker, flags."""

from __future__ import annotations

import asyncio
import random

import pytest

from common.errors import ConfigError
from pdcluster.v1 import worker_pb2
from router.breaker import CircuitBreaker
from router.config import RouterConfig, WorkerSpec
from router.policies import RouteHint, make_policy, pick_rank
from router.prefix_index import PrefixIndex, block_hashes
from router.room_allocator import RoomAllocator
from router.timing_store import TimingStore
from router.workers import Lease, Worker

CFG = RouterConfig(prefix_block_tokens=4, balance_abs_threshold=4, balance_rel_threshold=1.5)


def worker(port: int, dp: int = 1, role: str = "decode", free: list[int] | None = None) -> Worker:
    w = Worker(WorkerSpec(f"127.0.0.1:{port}", role), CFG)  # type: ignore[arg-type]
    w.set_info(
        worker_pb2.ServerInfo(
            mode="decode" if role == "decode" else role,
            dp_size=dp,
            page_size=4,
            bootstrap_port=9 if role == "prefill" else 0,
        )
    )
    w.healthy = True
    w.admit()
    if free is not None:
        w.set_load(
            worker_pb2.GetLoadResponse(
                ranks=[worker_pb2.RankLoad(dp_rank=r, free_kv_pages=f) for r, f in enumerate(free)],
                page_size=4,
            )
        )
    return w


def hint(ids: list[int] | None = None, tokens: int = 8) -> RouteHint:
    return RouteHint(ids or [1, 2, 3], tokens)


async def test_round_robin_and_random() -> None:
    ws = [worker(1), worker(2), worker(3)]
    rr = make_policy("round_robin", CFG)
    assert [rr.pick(ws, hint())[0].address for _ in range(4)] == [w.address for w in ws + ws[:1]]
    rnd = make_policy("random", CFG, random.Random(0))
    assert {rnd.pick(ws, hint())[0].address for _ in range(50)} == {w.address for w in ws}


async def test_power_of_two_prefers_fewer_inflight_tokens() -> None:
    ws = [worker(1), worker(2)]
    Lease(ws[0], ws[0].ranks[0], tokens=1000, pages=0)
    p2 = make_policy("power_of_two", CFG, random.Random(1))
    assert all(p2.pick(ws, hint())[0] is ws[1] for _ in range(10))


async def test_cache_aware_follows_prefixes_per_rank_and_balances_under_skew() -> None:
    ws = [worker(1, dp=2), worker(2, dp=2)]
    ca = make_policy("cache_aware", CFG)
    prompt = list(range(100, 132))  # 8 blocks of 4
    _w, rank = ca.pick(ws, hint(prompt))
    assert rank is None  # nothing cached yet: least loaded, rank by load
    ca.routed(ws[1], 1, hint(prompt))
    assert ca.pick(ws, hint([*prompt, 7, 7, 7, 7])) == (ws[1], 1)
    assert ca.pick(ws, hint(list(range(500, 532))))[1] is None  # unrelated prompt: no match
    # Skewed load beats the cache: 10 in flight on ws[1] vs 0 on ws[0].
    for _ in range(10):
        Lease(ws[1], ws[1].ranks[0], tokens=1, pages=0)
    assert ca.pick(ws, hint(prompt)) == (ws[0], None)
    ca.forget(ws[1].address)
    assert ca.index.size(f"{ws[1].address}#1") == 0  # type: ignore[attr-defined]


async def test_dp_rank_by_load_and_free_pages_never_by_room() -> None:
    w = worker(1, dp=4, free=[100, 100, 100, 100])
    picks = []
    for _ in range(8):
        r = pick_rank(w, need_pages=1)
        Lease(w, w.ranks[r], tokens=4, pages=1)
        picks.append(r)
    assert sorted(picks) == [0, 0, 1, 1, 2, 2, 3, 3]  # spread evenly by in-flight count
    w2 = worker(2, dp=3, free=[1, 50, 2])
    assert pick_rank(w2, need_pages=10) == 1  # the only rank that can hold it
    w2.set_load(
        worker_pb2.GetLoadResponse(
            ranks=[
                worker_pb2.RankLoad(dp_rank=0, free_kv_pages=50, waiting=9),
                worker_pb2.RankLoad(dp_rank=1, free_kv_pages=50, waiting=3),
                worker_pb2.RankLoad(dp_rank=2, free_kv_pages=50, waiting=5),
            ]
        )
    )
    assert pick_rank(w2, need_pages=10) == 1  # least queued


async def test_dp_rank_is_the_least_loaded_whichever_rank_the_rotation_starts_at() -> None:
    """Four ranks of different loads: the same rank, picked from every rotation start (rotation alone would give
    four different ones). Load is the rank's queue first, then its in-flight tokens; a rank too full to hold the
    request loses to a busier one that can."""
    w = worker(1, dp=4)
    w.set_load(worker_pb2.GetLoadResponse(ranks=[worker_pb2.RankLoad(dp_rank=r, free_kv_pages=100, waiting=q)
                                                 for r, q in enumerate([3, 1, 5, 2])]))
    assert [pick_rank(w, need_pages=1) for _ in range(4)] == [1, 1, 1, 1]
    tokens = worker(2, dp=4, free=[100, 100, 100, 100])
    for rank, n in enumerate([300, 100, 400, 50]):  # one request each: equal queues, different tokens
        Lease(tokens, tokens.ranks[rank], tokens=n, pages=0)
    assert [pick_rank(tokens, need_pages=1) for _ in range(4)] == [3, 3, 3, 3]
    assert [pick_rank(tokens, need_pages=99) for _ in range(4)] == [3, 3, 3, 3]
    tokens.set_load(worker_pb2.GetLoadResponse(ranks=[worker_pb2.RankLoad(dp_rank=r, free_kv_pages=f)
                                                      for r, f in enumerate([100, 100, 100, 20])]))
    assert [pick_rank(tokens, need_pages=50) for _ in range(4)] == [1, 1, 1, 1]  # rank 3 cannot hold 50 pages


async def test_lease_reserves_pages_until_the_next_report() -> None:
    w = worker(1, free=[10])
    lease = Lease(w, w.ranks[0], tokens=32, pages=8)
    assert w.free_pages() == 2
    lease.release()
    assert w.free_pages() == 10 and w.inflight == 0
    lease2 = Lease(w, w.ranks[0], tokens=32, pages=8)
    w.set_load(worker_pb2.GetLoadResponse(ranks=[worker_pb2.RankLoad(dp_rank=0, free_kv_pages=2)]))
    assert w.free_pages() == 2  # the report now includes the request's pages
    lease2.release()
    assert w.free_pages() == 2


async def test_rooms_unique_under_concurrency() -> None:
    rooms = RoomAllocator(seed=0)

    async def draw() -> int:
        r = rooms.acquire()
        await asyncio.sleep(0)
        return r

    got = await asyncio.gather(*(draw() for _ in range(1000)))
    assert len(set(got)) == 1000 and all(0 < r < 2**63 for r in got)
    for r in got:
        rooms.release(r)
    assert not rooms.in_flight
    # A colliding generator still yields unique rooms.
    collide = RoomAllocator(seed=1)
    first = collide.acquire()
    collide._rng = random.Random(1)  # replays the same sequence
    assert collide.acquire() != first


def test_circuit_breaker_states() -> None:
    now = [0.0]
    cb = CircuitBreaker(failure_threshold=3, open_s=10, clock=lambda: now[0])
    for _ in range(2):
        cb.record_failure()
    assert cb.state == "closed" and cb.allows()
    cb.record_failure()
    assert cb.state == "open" and not cb.allows()
    now[0] = 10.0
    assert cb.state == "half_open" and cb.allows()
    cb.on_dispatch()
    assert not cb.allows()  # one probe at a time
    cb.record_failure()
    assert cb.state == "open"
    now[0] = 20.0
    cb.on_dispatch()
    cb.record_success()
    assert cb.state == "closed" and cb.failures == 0
    # A probe that never reports frees the slot after open_s.
    for _ in range(3):
        cb.record_failure()
    now[0] = 30.0
    cb.on_dispatch()
    now[0] = 41.0
    assert cb.allows()


def test_a_passing_health_check_half_opens_an_open_circuit_at_once() -> None:
    now = [0.0]
    cb = CircuitBreaker(failure_threshold=1, open_s=60, clock=lambda: now[0])
    cb.health_ok()
    assert cb.state == "closed"  # nothing to do on a closed circuit
    cb.record_failure()
    now[0] = 2.0
    assert cb.state == "open" and not cb.allows()
    cb.health_ok()
    assert cb.state == "half_open" and cb.allows()
    cb.on_dispatch()
    cb.record_failure()  # the early probe failed: open again, for a full cool-down unless health says otherwise
    assert cb.state == "open" and not cb.allows()


def test_worker_flags() -> None:
    assert WorkerSpec.parse("10.0.0.1:30001", "prefill") == WorkerSpec("10.0.0.1:30001", "prefill", None)
    assert WorkerSpec.parse("grpc://h:30001:8998", "prefill") == WorkerSpec("h:30001", "prefill", 8998)
    assert WorkerSpec.parse("h:30002", "decode").bootstrap_port is None
    for bad, role in (("h", "decode"), ("h:x", "decode"), ("h:1:2", "decode"), ("h:70000", "colocated")):
        with pytest.raises(ConfigError):
            WorkerSpec.parse(bad, role)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--prefill-policy"):
        RouterConfig(prefill_policy="fastest")
    with pytest.raises(ConfigError, match="given twice"):
        RouterConfig(workers=(WorkerSpec("h:1", "prefill"), WorkerSpec("h:1", "decode")))


async def test_a_worker_in_the_wrong_mode_is_not_routable() -> None:
    w = Worker(WorkerSpec("127.0.0.1:1", "prefill"), CFG)
    assert not w.set_info(worker_pb2.ServerInfo(mode="decode", bootstrap_port=5))
    assert "mode 'decode'" in w.error and not w.routable
    assert not w.set_info(worker_pb2.ServerInfo(mode="prefill"))
    assert "bootstrap port" in w.error


def test_prefix_index_and_timing_store() -> None:
    idx = PrefixIndex(block_tokens=2, max_blocks=3)
    h = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(h) == 3
    idx.insert("a", h)
    assert idx.match(h) == {"a": 3} and idx.match(block_hashes([1, 2, 9, 9], 2)) == {"a": 1}
    idx.insert("a", block_hashes([8, 8, 8, 8], 2))  # evicts the oldest blocks, leaves before their root
    assert idx.size("a") == 3 and idx.match(h) == {"a": 1}

    store = TimingStore(keep=2, ttl_s=1000)
    for rid in ("a", "b", "c"):
        store.put(rid, {"e2e": 1.0})
    assert store.get("a") is None and store.get("c") == {"e2e": 1.0}


def test_the_loop_counter_exports_what_prometheus_client_would() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from common.serving.loop_counter import LoopCounter

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    for name, labels in (("x_requests", ("api", "outcome")), ("x_tokens", ())):
        mine, ref = LoopCounter(name, "doc", labels, ours), Counter(name, "doc", labels, registry=theirs)
        for values, amount in (((), 3), ((), 0.5)) if not labels else (
                (("chat", "success"), 1), (("completions", "error"), 2), (("chat", "success"), 4)):
            mine.labels(*values).inc(amount) if labels else mine.inc(amount)
            ref.labels(*values).inc(amount) if labels else ref.inc(amount)
    with pytest.raises(ValueError):
        LoopCounter("x_bad", "doc", ("a", "b")).labels("only-one")

    def lines(r: CollectorRegistry) -> list[str]:
        return [ln for ln in generate_latest(r).decode().splitlines() if "_created" not in ln]
    assert lines(ours) == lines(theirs)
    created = [ln for ln in generate_latest(ours).decode().splitlines() if ln.startswith("x_requests_created")]
    assert len(created) == 2  # one per series, as prometheus_client writes them


def test_the_itl_histogram_exports_what_prometheus_client_would() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from common.serving.gap_histogram import GapHistogram
    from router.metrics import ITL_BUCKETS

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    gap = GapHistogram("x_itl_seconds", "doc", ITL_BUCKETS, ours)
    ref = Histogram("x_itl_seconds", "doc", buckets=ITL_BUCKETS, registry=theirs)
    for v in (0.0, 0.0005, 0.00051, 0.01, 0.0123, 2.5, 2.6, 100.0, 0.001):
        gap.observe(v)
        ref.observe(v)
    def lines(r: CollectorRegistry) -> list[str]:
        return [ln for ln in generate_latest(r).decode().splitlines() if "_created" not in ln]
    assert lines(ours) == lines(theirs)
