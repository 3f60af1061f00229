"""The seeds' per-rank log lines: one formatter for ``Prefill batch.`` and one for ``Decode batch.``.

Field order is SGLang's. The disaggregation fields appear only on the role that owns the queue (SGLang omits them
on colocated nodes): ``#bootstrap-req``/``#inflight-req`` on prefill nodes, ``#prealloc-req``/``#transfer-req``
on decode nodes. A role scheduler supplies its counts through ``SchedulerRole.queue_counts``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class DisaggQueueCounts:
    """Requests in a role's own queues at the time of a log line; ``None`` where the role has no such queue."""

    bootstrap: int | None = None
    inflight: int | None = None
    prealloc: int | None = None
    transfer: int | None = None


NO_DISAGG_QUEUES = DisaggQueueCounts()


@dataclass(frozen=True)
class PrefillStats:
    new_seq: int
    new_token: int
    cached_token: int
    token_usage: float
    running_req: int
    queue_req: int
    queues: DisaggQueueCounts = NO_DISAGG_QUEUES


@dataclass(frozen=True)
class DecodeStats:
    running_req: int
    token: int
    token_usage: float
    retracted_req: int
    gen_throughput: float
    queues: DisaggQueueCounts = NO_DISAGG_QUEUES


def format_prefill_line(s: PrefillStats) -> str:
    line = (
        f"Prefill batch. #new-seq: {s.new_seq}, #new-token: {s.new_token}, #cached-token: {s.cached_token}, "
        f"token usage: {s.token_usage:.2f}, #running-req: {s.running_req}, #queue-req: {s.queue_req}"
    )
    q = s.queues
    if q.bootstrap is not None or q.inflight is not None:
        line += f", #bootstrap-req: {q.bootstrap or 0}, #inflight-req: {q.inflight or 0}"
    return line


def format_decode_line(s: DecodeStats) -> str:
    line = f"Decode batch. #running-req: {s.running_req}, #token: {s.token}, token usage: {s.token_usage:.2f}, "
    q = s.queues
    if q.prealloc is not None or q.transfer is not None:
        line += f"#prealloc-req: {q.prealloc or 0}, #transfer-req: {q.transfer or 0}, "
    return line + f"#retracted-req: {s.retracted_req}, gen throughput (token/s): {s.gen_throughput:.2f}"


class DecodeLogInterval:
    """Counts decode steps, generated tokens and retractions between two ``Decode batch.`` lines.

    Invariant: every counter covers exactly the span since the last line (or since the rank was last idle);
    ``take`` resets them, so the throughput is the interval's tokens over the interval's wall time, and an idle
    rank's first line after new work is not diluted by the time it had nothing to do.
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.decode_steps = 0
        self.tokens = 0
        self.retracted = 0
        self.since = time.monotonic()

    def on_decode_step(self) -> bool:
        """Count one decode step; whether a line is due after it."""
        self.decode_steps += 1
        return self.decode_steps % self.interval == 0

    def restart(self) -> None:
        """The rank is idle: the next interval starts now (the step cadence is kept)."""
        self.since, self.tokens = time.monotonic(), 0

    def take(self) -> tuple[float, int]:
        """(gen throughput in token/s, retractions) over the interval; starts the next interval."""
        now = time.monotonic()
        throughput = self.tokens / max(now - self.since, 1e-6)
        retracted = self.retracted
        self.since, self.tokens, self.retracted = now, 0, 0
        return throughput, retracted
