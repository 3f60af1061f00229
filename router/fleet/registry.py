"""``Registry``: the router's workers by address, and what routing reads of them: each role's routable workers
(the per-role views, ``router.fleet.candidates``) and among those the candidates for one request (``candidates``).
Mutated only on the event loop thread.

Clients see a worker only by its ``name`` (``prefill-0``, ``decode-1``, ... in registration order, kept across
deregistration); the address stays on the admin surface.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from pdcluster.v1 import worker_pb2
from router.config import Role, RouterConfig, WorkerSpec
from router.fleet.candidates import Candidates, RoleView
from router.fleet.worker import Worker

logger = logging.getLogger(__name__)


class NoRoom(Exception):
    """Every routable decode worker's last report says it cannot admit the request now."""


class Registry:
    """Workers by address. Mutated only on the event loop thread."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.workers: dict[str, Worker] = {}
        self._views: dict[Role, RoleView[Worker]] = {"prefill": RoleView(), "decode": RoleView(), "colocated": RoleView()}
        self._seq = 0
        self._names: dict[tuple[str, Role], str] = {}  # (address, role) -> name; kept across deregistration

    def add(self, spec: WorkerSpec) -> tuple[Worker, bool]:
        """Register (idempotent for the same address and role); returns (worker, created)."""
        old = self.workers.get(spec.address)
        if old is not None:
            if old.role != spec.role:
                raise ValueError(
                    f"worker {spec.address} is already registered as {old.role}; deregister it first"
                )
            return old, False
        w = Worker(spec, self.cfg, self._name(spec))
        self._seq += 1
        w.seq, w.view = self._seq, self._views[spec.role]
        self.workers[spec.address] = w
        w.view.add(w)
        logger.info("worker added: %s (%s) as %s", spec.address, spec.role, w.name)
        return w, True

    def remove(self, address: str) -> bool:
        """New requests stop going to the worker at once; its in-flight requests finish."""
        w = self.workers.pop(address, None)
        if w is None:
            return False
        w.removed = True
        self._views[w.role].remove(w)
        w.view = None
        if w.inflight == 0:
            w.close_soon()
        logger.info("worker removed: %s (%s), %d in flight", address, w.role, w.inflight)
        return True

    def _name(self, spec: WorkerSpec) -> str:
        key = (spec.address, spec.role)
        if key not in self._names:
            n = sum(1 for _, role in self._names if role == spec.role)
            self._names[key] = f"{spec.role}-{n}"
        return self._names[key]

    def peer_infos(self, w: Worker) -> list[worker_pb2.ServerInfo]:
        """Server infos of the other accepted workers of ``w``'s role (what ``w``'s facts must agree with)."""
        return [o.info for o in self.workers.values()
                if o is not w and o.role == w.role and o.info is not None and not o.error and not o.removed]

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self.workers.values()))

    def routable(self, role: Role) -> Candidates[Worker]:
        """Routable workers of ``role``. When none is, but some are held back by their circuit alone while their
        health checks pass, those: a breaker never blackholes a role whose workers say they serve. Read-only (the
        same list is handed out until a worker of the role changes); O(1) plus O(workers with a non-closed circuit).
        """
        return self._views[role].routable()

    def candidates(self, role: Role, failed: set[str], tokens: int, priority: int | None = None) -> Sequence[Worker]:
        """Routable workers of ``role`` that can hold a request of ``tokens`` KV tokens (decode: only those, or those
        where a request of ``priority`` may preempt a running one; ``NoRoom`` when none can), not yet failed for
        this request if possible.

        O(1) in the number of workers while none failed this request and the role's smallest free KV fits it (the
        views keep both current); the per-worker filters run only when they can remove someone."""
        ws: Sequence[Worker] = self.routable(role)
        # NOTE: free >= pages_for(tokens) <=> free * page_size >= tokens, so min_free_tokens >= tokens: all fit.
        # A decode worker whose last report cannot admit the request is never sent it, even when it is the only one
        # or the only one that has not failed this request.
        strict = role == "decode"
        if (len(ws) > 1 or strict) and ws and self.min_free_tokens(role) < tokens:
            fit = Candidates()
            for w in ws:
                free = w.free_pages()
                if free is None or free >= w.pages_for(tokens) or (strict and w.can_preempt_for(priority)):
                    fit.append(w)
            if strict and not fit:
                raise NoRoom(f"no decode worker reported room for the request's {tokens} prompt tokens "
                             f"({len(ws)} routable)")
            ws = fit or ws
        if len(ws) > 1 and failed:
            ws = Candidates(w for w in ws if w.address not in failed) or ws
        return ws

    def request_capacity(self) -> int | None:
        """Requests the ready workers hold at most by their own limits (``ServerInfo.max_requests_per_rank``): a PD
        pair's is the smaller bounded role's. None: unbounded (a role whose workers report no limit bounds nothing)."""
        views = self._views  # NOTE: O(1) per request: each view caches its sum until a worker changes
        groups: list[int | None] = []  # what each kind of serving (PD pairs, colocated workers) holds at most
        if views["prefill"].workers and views["decode"].workers:
            caps = [c for c in (views[r].request_capacity() for r in ("prefill", "decode")) if c is not None]
            groups.append(min(caps) if caps else None)
        if views["colocated"].workers:
            groups.append(views["colocated"].request_capacity())
        # No serving group, or one without a bound: nothing to refuse here (routing says why none can serve).
        return None if not groups or None in groups else sum(groups)  # type: ignore[arg-type]

    def low_priority_values_first(self) -> bool:
        """Whether the decode (or colocated) workers run --schedule-low-priority-values-first (a fleet agrees on
        it)."""
        return any(w.info.schedule_low_priority_values_first for role in ("decode", "colocated")
                   for w in self._views[role].workers if w.info is not None)

    async def wait_room_change(self, role: Role, timeout: float) -> None:
        await self._views[role].wait_room_change(timeout)

    def min_free_tokens(self, role: Role) -> float:
        """A lower bound of the KV tokens any worker of ``role`` can take now (inf: no worker reported yet)."""
        return self._views[role].capacity.min_tokens()

    def has_role(self, role: Role) -> bool:
        return any(w.role == role for w in self.workers.values())

    def context_len(self) -> int | None:
        lens = [
            w.info.context_len for w in self.workers.values()
            if w.info is not None and w.info.context_len > 0 and not w.error
        ]
        return min(lens) if lens else None

    async def close(self) -> None:
        for w in list(self.workers.values()):
            await w.close()
        self.workers.clear()
        self._views = {"prefill": RoleView(), "decode": RoleView(), "colocated": RoleView()}
