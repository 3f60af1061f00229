"""How fast a queue drains, for a ``Retry-After`` derived from the queue instead of a fixed guess: the rate of the
last completions (a window of ``WINDOW_S`` seconds, at most ``KEEP`` of them), and the wait of a request with
``ahead`` requests before it."""

from __future__ import annotations

import collections
import time

WINDOW_S = 10.0
KEEP = 4096
MIN_RETRY_S = 0.05
MAX_RETRY_S = 60.0
NO_RATE_RETRY_S = 1.0  # nothing finished within the window: no evidence of a rate


class DrainRate:
    def __init__(self) -> None:
        self._done: collections.deque[float] = collections.deque(maxlen=KEEP)

    def completed(self, now: float | None = None) -> None:
        self._done.append(time.monotonic() if now is None else now)

    def per_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._done and now - self._done[0] > WINDOW_S:
            self._done.popleft()
        if not self._done:
            return 0.0
        return len(self._done) / max(now - self._done[0], WINDOW_S / 10)

    def wait_s(self, ahead: int, now: float | None = None) -> float:
        """Seconds until ``ahead`` more requests have finished at the recent rate (clamped)."""
        rate = self.per_s(now)
        if rate <= 0:
            return NO_RATE_RETRY_S * max(1, ahead)
        return min(max(ahead / rate, MIN_RETRY_S), MAX_RETRY_S)
