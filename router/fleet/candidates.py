"""What routing reads of one role's workers, kept up to date as workers change instead of rebuilt per decision.

A routing decision used to ask every worker of both roles whether it is routable and has free KV pages: O(workers)
per decision. ``RoleView`` keeps instead:

    ready     the routable workers whose circuit is closed, in registration order: rebuilt (O(workers)) only after
              a worker of the role changed state (health, membership, server info, errors, removal, circuit closing
              or opening), never per decision
    timed     the workers usable but for a circuit that is not closed: their circuit moves with the clock (open ->
              half-open, a half-open probe's slot freeing), so each is asked at every decision: O(such workers)
    capacity  a lower bound of the KV tokens any worker of the role can take now (``CapacityIndex``): when a
              request fits under it, every worker fits and the per-worker KV filter is skipped

Invariants: ``routable()`` equals ``[w for w in workers if w.routable]``, or when that is empty
``[w for w in workers if w.usable_but_for_circuit]`` (a breaker never blackholes a role whose workers say they serve);
``CapacityIndex.min_tokens()`` <= ``free_pages() * page_size`` of every worker of the role with a known count.
Workers tell their view through ``Worker.state_changed`` and ``Worker.free_changed``; both run on the event loop.

This module knows a worker only as ``ViewedWorker`` (what the views read of it), so ``router.fleet.worker``, whose
workers tell the views, is imported by nobody here: the views sit below the workers and the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

from pdcluster.v1 import worker_pb2
from router.fleet.breaker import CircuitBreaker


class ViewedWorker(Protocol):
    """What the views read of a worker (``router.fleet.worker.Worker`` is the one kind the registry holds)."""

    seq: int  # registration order
    address: str
    breaker: CircuitBreaker
    page_size: int

    @property
    def info(self) -> worker_pb2.ServerInfo | None: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def usable_but_for_circuit(self) -> bool: ...
    def free_pages(self) -> int | None: ...


W = TypeVar("W", bound=ViewedWorker)  # the worker type a registry keeps views of


class Candidates(list[W], Generic[W]):
    """Workers a policy picks from; read-only once built (a registry view hands out the same one until a change).
    ``by_address`` is built once per list."""

    __slots__ = ("_by_address",)

    def __init__(self, workers: Iterable[W] = ()) -> None:
        super().__init__(workers)
        self._by_address: dict[str, W] | None = None

    def by_address(self) -> dict[str, W]:
        d = self._by_address
        if d is None:
            d = self._by_address = {w.address: w for w in self}
        return d


class CapacityIndex(Generic[W]):
    """Min over the role's workers of the KV tokens each can take now (``free_pages() * page_size``; a worker with
    no report yet bounds nothing). Lazy: a worker whose count changed is only marked (``touch``, O(1)) and re-read
    at the next ``min_tokens``; a heap holds one live entry per worker plus stale ones, dropped when they reach the
    top and compacted when they outnumber the live ones."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int]] = []  # (tokens, worker seq, generation)
        self._gen: dict[int, int] = {}  # worker seq -> generation of its live entry (members only)
        self._members: dict[int, W] = {}
        self._dirty: dict[int, W] = {}

    def add(self, w: W) -> None:
        self._members[w.seq] = w
        self._gen[w.seq] = 0
        self._dirty[w.seq] = w

    def drop(self, w: W) -> None:
        self._members.pop(w.seq, None)
        self._gen.pop(w.seq, None)  # its heap entries are stale from now on
        self._dirty.pop(w.seq, None)

    def touch(self, w: W) -> None:
        if w.seq in self._members:
            self._dirty[w.seq] = w

    def min_tokens(self) -> float:
        if self._dirty:
            gen, heap = self._gen, self._heap
            for seq, w in self._dirty.items():
                g = gen[seq] = gen[seq] + 1
                free = w.free_pages()
                if free is not None:
                    heapq.heappush(heap, (free * w.page_size, seq, g))
            self._dirty.clear()
            if len(heap) > 2 * len(gen) + 16:
                self._compact()
        heap, gen = self._heap, self._gen
        while heap and gen.get(heap[0][1]) != heap[0][2]:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def _compact(self) -> None:
        gen = self._gen
        self._heap = [e for e in self._heap if gen.get(e[1]) == e[2]]
        heapq.heapify(self._heap)


class RoleView(Generic[W]):
    """One role's workers (registration order) and the views above."""

    def __init__(self) -> None:
        self.workers: list[W] = []
        self.capacity: CapacityIndex[W] = CapacityIndex()
        self._ready: Candidates[W] | None = None  # None: a worker changed state since the last build
        self._timed: list[W] = []
        self._room: asyncio.Future[None] | None = None  # set at the next change of a worker's free pages
        self._requests: int | None = None  # requests the ready workers hold at most (None: one reports no bound)

    def room_changed(self) -> None:
        if self._room is not None:
            if not self._room.done():
                self._room.set_result(None)
            self._room = None

    async def wait_room_change(self, timeout: float) -> None:
        """Until a worker's free pages change (a load report, a lease's release), at most ``timeout`` seconds."""
        if self._room is None:
            self._room = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._room), timeout)

    def add(self, w: W) -> None:
        self.workers.append(w)
        self.capacity.add(w)
        self.invalidate()

    def remove(self, w: W) -> None:
        self.workers.remove(w)
        self.capacity.drop(w)
        self.invalidate()

    def invalidate(self) -> None:
        self._ready = None

    def routable(self) -> Candidates[W]:
        """See the module's invariant. Read-only: the same list is handed out until a worker changes."""
        ready = self._ready
        if ready is None:
            ready = self._build()
        if not self._timed:
            return ready
        extra = [w for w in self._timed if w.breaker.allows()]
        if extra:
            return Candidates(sorted([*ready, *extra], key=_seq))
        return ready or Candidates(self._timed)

    def request_capacity(self) -> int | None:
        """Requests the role's ready workers hold at most by their own limits (None: a worker reports none)."""
        if self._ready is None:
            self._build()
        return self._requests

    def _build(self) -> Candidates[W]:
        ready: Candidates[W] = Candidates()
        timed: list[W] = []
        for w in self.workers:
            if w.usable_but_for_circuit:
                (ready if w.breaker.closed else timed).append(w)
        self._ready, self._timed = ready, timed
        limits = [w.dp_size * w.info.max_requests_per_rank for w in ready if w.info is not None]
        # No ready worker bounds nothing here: routing then says why none can serve (503), not a 429.
        self._requests = sum(limits) if ready and len(limits) == len(ready) and all(limits) else None
        return ready


def _seq(w: ViewedWorker) -> int:
    return w.seq
