"""Circuit breaker per worker: closed -> open after N consecutive failures -> half-open after a cool-down.

Half-open lets one probe request through at a time; its success closes the circuit, its failure re-opens it. A
probe that ends with neither (client cancel) frees the slot after another ``open_s``. A passing health check
half-opens an open circuit at once (``health_ok``): a worker whose probes say it serves is tried again within one
health interval, not after the whole cool-down.
Only worker faults count (transport errors, crashes, timeouts), never a client's bad input.

``on_change`` is called whenever the circuit closes or leaves closed (the registry keeps its routable views by
it, ``router.fleet.candidates``); the timed moves among open and half-open need no call: such a worker is asked each
time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(
        self, failure_threshold: int, open_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.clock = clock
        self.failures = 0
        self.opened_at = 0.0
        self._state = CLOSED
        self._probe_at: float | None = None  # half-open: when the probe in flight was sent
        self.on_change: Callable[[], None] | None = None

    @property
    def closed(self) -> bool:
        """Closed now (a closed circuit stays closed until ``record_failure``, whatever the clock)."""
        return self._state == CLOSED

    def _set(self, state: str) -> None:
        was_closed = self._state == CLOSED
        self._state = state
        if was_closed != (state == CLOSED) and self.on_change is not None:
            self.on_change()

    @property
    def state(self) -> str:
        if self._state == OPEN and self.clock() - self.opened_at >= self.open_s:
            self._state, self._probe_at = HALF_OPEN, None
        return self._state

    def allows(self) -> bool:
        """May a request be routed here now? (Does not reserve the half-open probe; see ``on_dispatch``.)"""
        if self._state == CLOSED:  # NOTE: only OPEN moves with the clock; CLOSED needs no clock read
            return True
        state = self.state
        if state == CLOSED:
            return True
        return state == HALF_OPEN and (self._probe_at is None or self.clock() - self._probe_at >= self.open_s)

    def on_dispatch(self) -> None:
        if self.state == HALF_OPEN:
            self._probe_at = self.clock()

    def health_ok(self) -> None:
        if self.state == OPEN:
            self._state, self._probe_at = HALF_OPEN, None

    def record_success(self) -> None:
        self.failures, self._probe_at = 0, None
        if self._state != CLOSED:
            self._set(CLOSED)

    def record_failure(self) -> None:
        self.failures += 1
        if self._state == HALF_OPEN or self.failures >= self.failure_threshold:
            self.opened_at, self._probe_at = self.clock(), None
            self._set(OPEN)
