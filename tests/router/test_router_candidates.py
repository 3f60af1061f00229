"""The registry's incremental routing views (router/fleet/candidates.py): after any sequence of worker changes they answer
exactly what a scan of every worker answers - routable workers (health, membership, errors, removal, circuit
breaker with its clock, draining-by-removal) and the KV bound that lets a decision skip the per-worker KV filter."""

from __future__ import annotations

import math
import random

from pdcluster.v1 import worker_pb2
from router.config import RouterConfig, WorkerSpec
from router.fleet.registry import Registry
from router.fleet.worker import Lease, Worker

PAGE = 4
CFG = RouterConfig(cb_failure_threshold=2, cb_open_s=10.0)


def _report(free: int, dp_rank: int = 0) -> worker_pb2.RankLoad:
    return worker_pb2.RankLoad(dp_rank=dp_rank, free_kv_pages=free, total_kv_pages=1000)


def _ready(reg: Registry, role: str, port: int, dp: int = 1, clock: list[float] | None = None) -> Worker:
    mode = {"prefill": "prefill", "decode": "decode"}[role]
    w, _ = reg.add(WorkerSpec(f"127.0.0.1:{port}", role, 9 if role == "prefill" else 0))  # type: ignore[arg-type]
    if clock is not None:
        w.breaker.clock = lambda: clock[0]
    w.admit()
    assert w.set_info(worker_pb2.ServerInfo(mode=mode, dp_size=dp, page_size=PAGE, bootstrap_port=9,
                                            context_len=4096))
    w.healthy = True
    return w


def _scan_routable(reg: Registry, role: str) -> list[Worker]:
    """What ``Registry.routable`` answered before it kept views: a scan of every worker of the role."""
    of_role = [w for w in reg.workers.values() if w.role == role]
    return [w for w in of_role if w.routable] or [w for w in of_role if w.usable_but_for_circuit]


def _scan_min_tokens(reg: Registry, role: str) -> float:
    free = [(w.free_pages(), w.page_size) for w in reg.workers.values() if w.role == role]
    known = [f * ps for f, ps in free if f is not None]
    return min(known) if known else math.inf


async def test_routable_view_follows_health_membership_errors_circuit_and_removal() -> None:
    now = [0.0]
    reg = Registry(CFG)
    a, b, c = (_ready(reg, "decode", p, clock=now) for p in (1, 2, 3))
    view = reg.routable("decode")
    assert view == [a, b, c]
    assert reg.routable("decode") is view  # nothing changed: the same list, no scan

    b.healthy = False
    assert reg.routable("decode") == [a, c]
    b.healthy = True
    c.reject("wrong proof")
    assert reg.routable("decode") == [a, b]
    c.admit()
    a.load_error = "absurd report"
    assert reg.routable("decode") == [b, c]
    a.load_error = ""
    assert reg.routable("decode") == [a, b, c]

    # Circuit: open after 2 failures; half-open after cb_open_s (the clock, no call); one probe at a time.
    b.breaker.record_failure()
    b.breaker.record_failure()
    assert reg.routable("decode") == [a, c]
    now[0] = 11.0
    assert reg.routable("decode") == [a, b, c]  # half-open: back in registration order
    lease = Lease(b, b.ranks[0], tokens=4, pages=1)  # the probe
    assert reg.routable("decode") == [a, c]
    b.breaker.record_success()
    lease.release()
    assert reg.routable("decode") == [a, b, c]

    # Every worker's circuit open: those whose health checks pass are still offered (no blackhole).
    for w in (a, b, c):
        w.breaker.record_failure()
        w.breaker.record_failure()
    assert reg.routable("decode") == [a, b, c] == _scan_routable(reg, "decode")
    for w in (a, b, c):
        w.breaker.record_success()

    # Removal (deregistration, draining a worker out): gone at once, even with requests in flight.
    held = Lease(c, c.ranks[0], tokens=4, pages=1)
    assert reg.remove(c.address)
    assert reg.routable("decode") == [a, b]
    held.release()
    d = _ready(reg, "decode", 3, clock=now)  # the same address comes back: a new worker, last in order
    assert reg.routable("decode") == [a, b, d]
    assert reg.routable("prefill") == []
    await reg.close()


async def test_min_free_tokens_follows_leases_reports_and_removal() -> None:
    reg = Registry(CFG)
    a = _ready(reg, "decode", 1)
    b = _ready(reg, "decode", 2, dp=2)
    assert reg.min_free_tokens("decode") == math.inf  # no report yet: nothing bounds a request
    a.set_load(worker_pb2.GetLoadResponse(page_size=PAGE, ranks=[_report(100)]))
    b.set_load(worker_pb2.GetLoadResponse(page_size=PAGE, ranks=[_report(30), _report(50, 1)]))
    assert reg.min_free_tokens("decode") == 50 * PAGE  # b's best rank
    lease = Lease(b, b.ranks[1], tokens=160, pages=40)
    assert reg.min_free_tokens("decode") == 30 * PAGE  # rank 1 now has 10: rank 0's 30 is b's best
    lease.release()
    assert reg.min_free_tokens("decode") == 50 * PAGE
    a.set_load(worker_pb2.GetLoadResponse(page_size=PAGE, ranks=[_report(5)]))
    assert reg.min_free_tokens("decode") == 5 * PAGE
    reg.remove(a.address)
    assert reg.min_free_tokens("decode") == 50 * PAGE
    await reg.close()


async def test_candidates_filter_kv_by_prompt_length_and_failed_workers() -> None:
    reg = Registry(CFG)
    a, b, c = (_ready(reg, "decode", p) for p in (1, 2, 3))
    for w, free in ((a, 100), (b, 10), (c, 100)):
        w.set_load(worker_pb2.GetLoadResponse(page_size=PAGE, ranks=[_report(free)]))
    assert reg.candidates("decode", set(), 40) == [a, b, c]  # 10 pages hold 40 tokens
    assert reg.candidates("decode", set(), 41) == [a, c]  # one token more: b cannot hold it
    assert reg.candidates("decode", {a.address}, 41) == [c]
    # The only one not failed cannot hold it: a failed one that can is tried again (b's report says no room).
    assert reg.candidates("decode", {a.address, c.address}, 41) == [a, c]
    lease = Lease(c, c.ranks[0], tokens=400, pages=95)  # c has 5 left until its next report
    assert reg.candidates("decode", set(), 41) == [a]
    c.set_load(worker_pb2.GetLoadResponse(page_size=PAGE, ranks=[_report(100)]))  # the report includes them
    assert reg.candidates("decode", set(), 41) == [a, c]
    lease.release()
    b.healthy = False
    assert reg.candidates("decode", set(), 41) == [a, c]
    await reg.close()


async def test_views_match_a_full_scan_under_random_changes() -> None:
    rng = random.Random(7)
    now = [0.0]
    reg = Registry(CFG)
    ports = iter(range(100, 10_000))
    for _ in range(12):
        _ready(reg, rng.choice(["prefill", "decode"]), next(ports), dp=rng.choice([1, 2]), clock=now)
    leases: list[Lease] = []
    for step in range(3000):
        ws = list(reg.workers.values())
        w = rng.choice(ws)
        op = rng.randrange(12)
        if op == 0:
            w.healthy = not w.healthy
        elif op == 1:
            w.reject("x") if w.proven else w.admit()
        elif op == 2:
            w.load_error = "" if w.load_error else "bad"
        elif op == 3:
            w.breaker.record_failure()
        elif op == 4:
            w.breaker.record_success()
        elif op == 5:
            w.breaker.health_ok()
        elif op == 6:
            now[0] += rng.choice([1.0, 6.0, 11.0])
        elif op == 7:
            w.set_load(worker_pb2.GetLoadResponse(
                page_size=PAGE, ranks=[_report(rng.randrange(0, 200), r) for r in range(w.dp_size)]))
        elif op in (8, 9):
            r = rng.randrange(w.dp_size)
            leases.append(Lease(w, w.ranks[r], tokens=rng.randrange(1, 400), pages=rng.randrange(0, 60)))
        elif op == 10 and leases:
            leases.pop(rng.randrange(len(leases))).release()
        elif op == 11 and len(ws) > 4:
            reg.remove(w.address)
            if rng.random() < 0.7:
                _ready(reg, w.role, next(ports), dp=rng.choice([1, 2]), clock=now)
        for role in ("prefill", "decode"):
            assert reg.routable(role) == _scan_routable(reg, role), (step, op, role)  # type: ignore[arg-type]
            assert reg.min_free_tokens(role) == _scan_min_tokens(reg, role), (step, op, role)  # type: ignore[arg-type]
    for lease in leases:
        lease.release()
    assert all(w.inflight == 0 for w in reg.workers.values())
    await reg.close()
