"""``Drain``: the router's graceful stop of its generation calls (SIGTERM, ``--drain-timeout``).

    open --begin--> draining --no call left--> drained
                        \\--timeout (or expire_now)--> what remains is cancelled --> drained

While draining a new call is refused (UNAVAILABLE / HTTP 503) and the router reports not ready, so a load balancer
stops sending; calls in flight go on. A call cancelled at the deadline ends with UNAVAILABLE: its task is cancelled,
which closes its legs and so aborts them on both nodes (they free the request's KV pages).

One call is one task (an aiohttp handler, a grpc.aio RPC); ``guard`` runs inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from router.errors import UnavailableError
from router.request import Delta, Final

REFUSED = "the router is shutting down and takes no new requests; retry on another router replica"
CUT_SHORT = "the router shut down before the request finished (its --drain-timeout passed)"


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self._calls: dict[asyncio.Task[Any], str] = {}  # call's task -> request id
        self._expired: set[asyncio.Task[Any]] = set()  # tasks cancelled by the drain (not by their client)
        self._changed = asyncio.Event()  # set when a call ends or expire_now is called
        self._expire_now = False

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    async def guard(self, rid: str, events: AsyncIterator[Delta | Final]) -> AsyncIterator[Delta | Final]:
        """``events`` unless the router is draining (then UnavailableError at the first step); a call cut short
        by the drain ends with UnavailableError instead of CancelledError."""
        if self.draining:
            raise UnavailableError(REFUSED)
        task = asyncio.current_task()
        assert task is not None
        self._calls[task] = rid
        try:
            async with contextlib.aclosing(events):
                async for ev in events:
                    yield ev
        except asyncio.CancelledError:
            if task not in self._expired:
                raise
            task.uncancel()
            raise UnavailableError(CUT_SHORT) from None
        finally:
            del self._calls[task]
            self._expired.discard(task)
            self._changed.set()

    def expire_now(self) -> None:
        """Cut the wait short (a second SIGTERM): what remains is cancelled at once."""
        self._expire_now = True
        self._changed.set()

    async def run(self, timeout_s: float, unwind_s: float) -> list[str]:
        """Refuse new calls; wait up to ``timeout_s`` for the calls in flight; cancel what remains and wait up to
        ``unwind_s`` for those to end. Returns the request ids that were cancelled."""
        self.draining = True
        await self._wait(lambda: not self._calls or self._expire_now, timeout_s)
        cut = list(self._calls.items())
        for task, _ in cut:
            self._expired.add(task)
            task.cancel()
        await self._wait(lambda: not self._calls, unwind_s)
        return [rid for _, rid in cut]

    async def _wait(self, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
