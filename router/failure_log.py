"""Per-request failure lines, with an outage's repeats folded into one line per window.

A router that loses its only prefill worker fails every request the same way until the worker is back: a WARNING
per request (5,424 identical lines in the soak's 20 s prefill stall) buries the one line that says what happened.
The first failure of each kind (status and text) is logged as before; the same failure again within ``window_s``
is counted, and when the window ends one line says how many more requests failed that way and names the last one.

Invariant: every failed request is in the log, by its own line or in its window's count. The router keeps two:
its requests' failures, and its fire-and-forget ``Worker.Abort`` calls' (to a stalled or killed node every abort
fails the same way).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 10.0
MAX_KINDS = 256  # kinds held at once; a text that names its request makes each failure a kind of its own


@dataclass
class _Window:
    opened: float
    folded: int = 0
    last_rid: str = ""
    timer: asyncio.TimerHandle | None = None


class FailureLog:
    def __init__(self, logger: logging.Logger, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic, what: str = "failed", many: str = "requests") -> None:
        """``what``: the first line's verb (``[rid=..] <what>: CODE: text``); ``many``: what the count line counts."""
        self._log = logger
        self._what, self._many = what, many
        self.window_s = window_s
        self._clock = clock
        self._windows: dict[tuple[str, str], _Window] = {}

    def failed(self, rid: str, code: str, text: str) -> None:
        key = (code, text)
        now = self._clock()
        w = self._windows.get(key)
        if w is not None and now - w.opened < self.window_s:
            w.folded += 1
            w.last_rid = rid
            if w.timer is None:
                w.timer = _call_later(w.opened + self.window_s - now, self._close, key)
            return
        if w is not None:
            self._close(key)
        self._log.warning("[rid=%s] %s: %s: %s", rid, self._what, code, text)
        if len(self._windows) >= MAX_KINDS:
            for old in [k for k, v in self._windows.items() if now - v.opened >= self.window_s] or [*self._windows]:
                self._close(old)
        self._windows[key] = _Window(now)

    def _close(self, key: tuple[str, str]) -> None:
        w = self._windows.pop(key, None)
        if w is None:
            return
        if w.timer is not None:
            w.timer.cancel()
        if w.folded:
            self._log.warning("%d more %s failed the same way within %.0f s (the last: rid=%s): %s: %s",
                              w.folded, self._many, self.window_s, w.last_rid, *key)

    def close(self) -> None:
        """Log every window's count now (the router is stopping)."""
        for key in [*self._windows]:
            self._close(key)


def _call_later(delay: float, fn: Callable[..., object], *args: object) -> asyncio.TimerHandle | None:
    try:
        return asyncio.get_running_loop().call_later(max(0.0, delay), fn, *args)
    except RuntimeError:  # no loop (a test driving it by hand): the next failure of the kind or close() logs it
        return None
