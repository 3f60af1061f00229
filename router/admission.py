"""The router's request limit (``--max-inflight-requests``), checked *before* a request is parsed into tokens:
a request that will be refused is refused at once, never after waiting behind the burst it is part of.

``held``: requests being tokenized plus requests in flight (``RouterCore.active``), bounded by the router's limit and by
what its workers' own limits admit (``ServerInfo.max_requests_per_rank``), so the two agree. Refusals carry a
``Retry-After`` derived from the queue: the time the recent completion rate needs to free a slot for this request.

``HeldRequests``: admitted requests that no decode worker has room for wait in line (``RouterCore._plan``), most
urgent first (``hold_order``: the decode nodes' priority order, then arrival). Only the first in line routes, so
room that frees goes to the most urgent request; a newcomer routes at once only when it would be first.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from common.serving.drain_rate import DrainRate
from router.errors import OverloadedError


class Admission:
    def __init__(self, limit: int, workers_hold: Callable[[], int | None] = lambda: None) -> None:
        self.limit = limit  # 0: unbounded
        self.workers_hold = workers_hold  # what the workers' own limits admit at most (None: unbounded)
        self.tokenizing = 0
        self.rate = DrainRate()

    def check(self, in_flight: int, with_tokenizing: bool = True) -> None:
        """Raise ``OverloadedError`` when ``in_flight`` (plus the requests being tokenized) reach the limit."""
        held = in_flight + (self.tokenizing if with_tokenizing else 0)
        if self.limit and held >= self.limit:
            wait = self.rate.wait_s(held - self.limit + 1)
            raise OverloadedError(
                f"the router holds {held} requests, its limit (--max-inflight-requests); retry in {wait:.1f} s",
                wait,
            )
        workers = self.workers_hold()
        if workers is not None and held >= workers:
            wait = self.rate.wait_s(held - workers + 1)
            raise OverloadedError(
                f"the workers hold {held} requests from this router, all their limits allow (--max-running-requests + "
                f"--max-queued-requests per DP rank); retry in {wait:.1f} s", wait)

    @contextlib.contextmanager
    def tokenizing_one(self, in_flight: int) -> Iterator[None]:
        """Check, then count one request as held while it is tokenized (``RouterCore.generate`` counts it after)."""
        self.check(in_flight)
        self.tokenizing += 1
        try:
            yield
        finally:
            self.tokenizing -= 1


HoldOrder = tuple[float, float, int]
Plan = TypeVar("Plan")


def hold_order(priority: int | None, arrival: float, low_values_first: bool, seq: int) -> HoldOrder:
    """Smaller is served first: the nodes' priority order (a larger value first, unless the decode nodes run
    --schedule-low-priority-values-first; a request without a priority last), then arrival (FCFS), then ``seq``."""
    urgency = math.inf if priority is None else (priority if low_values_first else -priority)
    return (urgency, arrival, seq)


class NoRoom(Exception):
    """Every routable decode worker's last report says it cannot admit the request now."""


class NotAdmitted(Exception):
    """A held request's wait ended (``give_up``) before a decode worker had room for it; the text says why."""


class _Held:
    __slots__ = ("order", "turn")

    def __init__(self, order: HoldOrder) -> None:
        self.order = order
        self.turn = asyncio.Event()  # set when it became first in line

    def __lt__(self, other: _Held) -> bool:
        return self.order < other.order


class HeldRequests:
    """The line of held requests. Invariants: only the first routes; whenever the first leaves (routed, refused,
    timed out, cancelled) the next one's ``turn`` is set and it tries at once (the room may fit it too), so the line
    never stalls behind a request that left. Its length is bounded by the router's in-flight limit."""

    def __init__(self) -> None:
        self._line: list[_Held] = []  # sorted by order
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._line)

    async def route_in_order(
        self,
        route: Callable[[], Plan],
        order: Callable[[int], HoldOrder],
        room_change: Callable[[float], Awaitable[None]],
        give_up: float,
    ) -> Plan:
        """``route()``, or when it raises ``NoRoom`` (or others wait before this request) hold the request in line
        and route it when it is first and room changed; ``NotAdmitted`` at ``give_up`` (``time.monotonic()``).
        ``order(seq)``: the request's ``hold_order``; ``room_change(timeout)`` returns when free pages change."""
        reason, mine = "", order(next(self._seq)) if self._line else None  # NOTE: no order's cost when none wait
        if mine is None or mine < self._line[0].order:
            try:
                return route()
            except NoRoom as e:
                reason = str(e)
        me = _Held(mine if mine is not None else order(next(self._seq)))
        bisect.insort(self._line, me)
        try:
            while True:
                left = give_up - time.monotonic()
                if left <= 0:
                    ahead = bisect.bisect_left(self._line, me)
                    raise NotAdmitted(reason or f"{ahead} more urgent or earlier request(s) wait for room first")
                await self._wait(me, room_change, left)
                if self._line[0] is me:
                    try:
                        return route()
                    except NoRoom as e:
                        reason = str(e)
        finally:
            was_first = self._line[0] is me
            self._line.remove(me)
            if was_first and self._line:
                self._line[0].turn.set()

    async def _wait(self, me: _Held, room_change: Callable[[float], Awaitable[None]], timeout: float) -> None:
        """Until ``me`` became first in line or, while it is first, room changed; at most ``timeout`` seconds."""
        me.turn.clear()
        waits = [asyncio.ensure_future(me.turn.wait())]
        if self._line[0] is me:
            waits.append(asyncio.ensure_future(room_change(timeout)))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
