"""The router's request limit (``--max-inflight-requests``), checked *before* a request is parsed into tokens:
a request that will be refused is refused at once, never after waiting behind the burst it is part of.

``held``: requests being tokenized plus requests in flight (``RequestPipeline.active``), bounded by the router's limit
and by what its workers' own limits admit (``ServerInfo.max_requests_per_rank``), so the two agree. Refusals carry a
``Retry-After`` derived from the queue: the time the recent completion rate needs to free a slot for this request.

Admitted requests that no decode worker has room for wait in line later, at routing (router/routing/hold.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

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
        """Check, then count one request as held while it is tokenized (``RequestPipeline`` counts it after)."""
        self.check(in_flight)
        self.tokenizing += 1
        try:
            yield
        finally:
            self.tokenizing -= 1
