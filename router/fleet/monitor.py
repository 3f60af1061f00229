"""Background monitoring of every registered worker: server info, grpc.health.v1 checks, load reports.

- A worker becomes routable once it proved the cluster secret (``router.fleet.membership``; before that it is sent no
  credential and no request), then ``GetServerInfo`` answered, its mode matches its role and its facts are sane
  and agree with the fleet's (``router.fleet.facts``) (``probe``). Load reports are checked the same way.
- A worker that turns unhealthy must prove membership again before it is routable (a process that took over its
  address after it died gets nothing).
- Health: every ``health_interval_s``; ``health_failure_threshold`` failures in a row mark it unhealthy, one
  success marks it healthy again (and fetches its info if it has none).
- Load: every ``load_interval_s`` ``GetLoad`` refreshes the per-rank reports the policies read; requests never wait
  for a load report.
- Both polls are spread over their interval (worker i of N starts i/N of it in), not fired at once: a burst of N
  RPCs would hold the event loop (and the nodes) for N RPCs' time, in front of requests. Per-worker metrics are
  exported with each worker's health check, not for all workers at the end of a round; a load round leaves out the
  workers whose pushed loads are fresh, so its cost is O(workers that need a poll), not O(workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2

from pdcluster.v1 import worker_pb2
from router.config import RouterConfig
from router.fleet.breaker import HALF_OPEN, OPEN
from router.fleet.facts import fleet_problem, info_problem, load_problem
from router.fleet.membership import challenge
from router.fleet.registry import Registry
from router.fleet.worker import Worker
from router.metrics import RouterMetrics
from router.mux.stream import LOAD_HEARTBEAT_S

logger = logging.getLogger(__name__)
CIRCUIT_VALUE = {HALF_OPEN: 1, OPEN: 2}
# A pushed load report older than this (the node pushes at least every LOAD_HEARTBEAT_S) brings polls back.
PUSH_STALE_S = 3 * LOAD_HEARTBEAT_S


class Monitor:
    def __init__(
        self, cfg: RouterConfig, registry: Registry, metrics: RouterMetrics, on_change: Callable[[], None]
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.on_change = on_change  # called when server infos change (context length)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._health_loop()), loop.create_task(self._load_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def probe(self, w: Worker) -> bool:
        """Prove membership, then fetch server info, health and load once; True when the worker is routable."""
        timeout = self.cfg.rpc_timeout_s
        if not w.proven and not await self._prove(w):
            return False
        try:
            info = await w.stub.GetServerInfo(worker_pb2.GetServerInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            logger.info("worker %s (%s) not reachable yet: %s", w.address, w.role, e.code().name)
            return False
        problem = info_problem(info) or fleet_problem(info, self.registry.peer_infos(w))
        if problem:
            self._reject_facts(w, "info", problem)
            w.info_error = problem
            return False
        if not w.set_info(info):
            logger.error("worker %s cannot serve: %s", w.address, w.error)
            return False
        self.on_change()
        await self._load(w)  # NOTE: before health, so a worker with an absurd load report is never healthy-routable
        await self._check_health(w)
        logger.info(
            "worker %s (%s) ready: dp_size=%d page_size=%d context_len=%d bootstrap=%s healthy=%s",
            w.address,
            w.role,
            w.dp_size,
            w.page_size,
            info.context_len,
            w.bootstrap_addr if w.role == "prefill" else "-",
            w.healthy,
        )
        return w.routable

    async def _prove(self, w: Worker) -> bool:
        verdict = await challenge(w.stub, w.address, self.cfg.rpc_timeout_s)
        if verdict.proven:
            w.admit()
            logger.info("worker %s (%s) proved the cluster secret; admitted as %s", w.address, w.role, w.name)
            return True
        if verdict.unreachable:
            logger.info("worker %s (%s) %s", w.address, w.role, verdict.detail)
            return False
        if w.proof_error != verdict.detail:
            logger.warning("worker %s (%s) rejected, it gets no credential and no traffic: %s", w.address, w.role,
                           verdict.detail)
        w.reject(verdict.detail)
        self.metrics.worker_rejections.labels(w.role, verdict.reason).inc()
        return False

    def _reject_facts(self, w: Worker, kind: str, problem: str) -> None:
        if problem not in (w.info_error, w.load_error):
            logger.warning("worker %s (%s) is not routable: it %s", w.address, w.role, problem)
        self.metrics.worker_rejections.labels(w.role, kind).inc()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self.registry), return_exceptions=False)

    async def _check_health(self, w: Worker) -> None:
        try:
            resp = await w.health_stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.cfg.rpc_timeout_s
            )
            ok = resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            ok = False
        if ok:
            if not w.healthy:
                logger.info("worker %s (%s) is healthy", w.address, w.role)
            w.healthy, w.health_failures = True, 0
            w.breaker.health_ok()
        else:
            w.health_failures += 1
            if w.healthy and w.health_failures >= self.cfg.health_failure_threshold:
                w.healthy, w.proven = False, False
                logger.warning(
                    "worker %s (%s) is unhealthy after %d failed health checks",
                    w.address,
                    w.role,
                    w.health_failures,
                )

    def _load_due(self, w: Worker) -> bool:
        """False while the worker pushes its load on a live Mux stream (then a round spends nothing on it)."""
        if w.mux.on_load is None:  # before any stream opens (a probe polls once before the worker is routable)
            w.mux.on_load, w.mux.load_interval_s = functools.partial(self._apply_load, w), self.cfg.load_interval_s
        age = w.mux.pushed_load_age()
        return age is None or age >= PUSH_STALE_S

    async def _load(self, w: Worker) -> None:
        """A ``GetLoad`` poll, unless the worker pushes its load on a live Mux stream; a routable worker that serves
        Mux gets its stream opened here, so later rounds need no poll."""
        if not self._load_due(w):
            return
        if w.routable and w.mux.supported and (w.mux.stream is None or not w.mux.stream.alive):
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                await w.mux.get(self.cfg.rpc_timeout_s)
        try:
            load = await w.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=self.cfg.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            logger.debug("GetLoad on %s failed: %s", w.address, e.code().name)
            return
        self._apply_load(w, load)

    def _apply_load(self, w: Worker, load: worker_pb2.GetLoadResponse) -> None:
        """A load report, polled or pushed: the policies read it once its facts are sane."""
        if w.info is None:
            return
        problem = load_problem(load, w.info)
        if problem:
            self._reject_facts(w, "load", problem)
        w.load_error = problem
        if not problem:
            w.set_load(load)

    async def _health_loop(self) -> None:
        while True:
            await _spread(self._health_one, list(self.registry), self.cfg.health_interval_s)

    async def _health_one(self, w: Worker) -> None:
        if w.info is None or not w.proven or w.info_error:
            await self.probe(w)
        else:
            await self._check_health(w)
        if not w.removed:
            self._export(w)  # NOTE: per worker, so the round's metric updates are spread with its checks

    async def _load_loop(self) -> None:
        while True:
            # NOTE: workers pushing fresh loads are left out of the round (no task, no wake-up each): with every
            # worker pushing, a round is one sleep. One whose pushes stop is polled from the next round on.
            ws = [w for w in self.registry if w.proven and w.info is not None and self._load_due(w)]
            await _spread(self._load, ws, self.cfg.load_interval_s)

    def _export(self, w: Worker) -> None:
        m = self.metrics
        m.worker_healthy.labels(w.address, w.role).set(1 if w.healthy else 0)
        m.worker_circuit_open.labels(w.address).set(CIRCUIT_VALUE.get(w.breaker.state, 0))
        m.worker_inflight.labels(w.address).set(w.inflight)


async def _spread(poll: Callable[[Worker], Awaitable[None]], workers: list[Worker], interval: float) -> None:
    """One round: ``poll(w)`` for each worker, started evenly over ``interval`` (the first after interval / N, the
    last at ``interval``, as one sleep then a gather did); returns when every poll of the round has.

    Invariant: one worker's poll never ends the round early or the loop that runs it. A worker removed during the
    round (its channel closed: calls on it raise ``UsageError``, not ``AioRpcError``) is skipped, and any other
    exception of a poll is logged; before, either killed the health or load loop for good, and a worker re-added
    later was never probed again (503 "not proven" until the router restarted)."""
    if not workers:
        await asyncio.sleep(interval)
        return
    step = interval / len(workers)
    tasks: list[tuple[Worker, asyncio.Future[None]]] = []
    try:
        for w in workers:
            await asyncio.sleep(step)
            if not w.removed:
                tasks.append((w, asyncio.ensure_future(poll(w))))
        results = await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
    finally:  # cancelled (the monitor stops): no poll outlives it
        for _, t in tasks:
            t.cancel()
    for (w, _), r in zip(tasks, results, strict=True):
        if isinstance(r, Exception) and not w.removed:
            logger.warning("%s of worker %s failed: %r", getattr(poll, "__name__", "poll"), w.address, r)
