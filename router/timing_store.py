"""Per-request timing breakdowns kept for ``GET /v1/requests/{id}/timing``: the last N requests, for at most T s."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any


class TimingStore:
    def __init__(self, keep: int, ttl_s: float) -> None:
        self.keep = keep
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()

    def put(self, rid: str, timing: dict[str, Any]) -> None:
        now = time.monotonic()
        self._items.pop(rid, None)
        self._items[rid] = (now, timing)
        self._expire(now)

    def get(self, rid: str) -> dict[str, Any] | None:
        self._expire(time.monotonic())
        item = self._items.get(rid)
        return None if item is None else item[1]

    def _expire(self, now: float) -> None:
        items = self._items
        while items and (len(items) > self.keep or now - next(iter(items.values()))[0] > self.ttl_s):
            items.popitem(last=False)
