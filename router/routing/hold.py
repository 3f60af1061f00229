"""``HeldRequests``: admitted requests that no decode worker has room for wait in line (``Planner.plan``), most
urgent first (``hold_order``: the decode nodes' priority order, then arrival). Only the first in line routes, so
room that frees goes to the most urgent request; a newcomer routes at once only when it would be first.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from router.fleet.registry import NoRoom

HoldOrder = tuple[float, float, int]
Plan = TypeVar("Plan")


def hold_order(priority: int | None, arrival: float, low_values_first: bool, seq: int) -> HoldOrder:
    """Smaller is served first: the nodes' priority order (a larger value first, unless the decode nodes run
    --schedule-low-priority-values-first; a request without a priority last), then arrival (FCFS), then ``seq``."""
    urgency = math.inf if priority is None else (priority if low_values_first else -priority)
    return (urgency, arrival, seq)


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
