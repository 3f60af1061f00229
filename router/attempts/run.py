"""``AttemptRunner``: one attempt on a ``Plan``: the legs on its workers (router/attempts/legs.py), their token
stream through the request's ``OutputState`` (router/attempts/output.py) to the client, and the ``Final`` when the
attempt finishes the request; ``LegError`` when it fails (router/attempts/recovery.py decides what follows).

A streaming request's deltas reach the client one of two ways, in order: a leg's sink (``MuxCall.sink``) takes a
chunk that arrives while the request's task waits and writes its delta to the client's ``DeltaSink`` from the
node's message callback, with no wake-up of the task; the task reads the others from the leg's stream and yields
them. The sink wakes the task only when a stop string matched in what it took.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdcluster.v1 import worker_pb2
from router.attempts.legs import Aborter, ColocatedAttempt, PdAttempt
from router.attempts.output import OutputState
from router.errors import LegError
from router.request import Delta, Final, GenRequest
from router.routing.planner import Plan
from router.timing_store import TimingStore


@dataclass(slots=True)
class Progress:
    """What one request's attempts share: its output so far and what their failures taught."""

    out: OutputState
    failed: set[str] = field(default_factory=set)  # workers that failed it: avoided while another exists
    exhausted: set[str] = field(default_factory=set)  # workers that answered RESOURCE_EXHAUSTED to it
    migrations: list[dict[str, Any]] = field(default_factory=list)  # one record per migration (the timing shows them)
    attempt: int = 0  # attempts that failed so far
    retries: int = 0  # of those, the ones that failed without producing a token
    first_dispatched_at: float | None = None
    first_leg: PdAttempt | ColocatedAttempt | None = None  # the attempt that produced the first token


class AttemptRunner:
    def __init__(self, aborter: Aborter, timings: TimingStore) -> None:
        self.aborter = aborter
        self.timings = timings  # each finished request's timing (``GET /v1/requests/{id}/timing``)

    async def run(
        self, req: GenRequest, node_req: worker_pb2.GenerateRequest, plan: Plan, pr: Progress
    ) -> AsyncIterator[Delta | Final]:
        """One attempt on ``plan``: deltas (streaming requests), then its Final; raises ``LegError`` on failure."""
        dispatched_at = time.monotonic()
        out = pr.out
        client = req.delta_sink if req.stream else None

        def take(msg: worker_pb2.GenerateResponse) -> bool:
            """The leg's sink: a chunk that arrives while this task waits goes to the client from here, with no
            wake-up of this task; the task looks again only when a stop string matched in it."""
            if client is None or out.stopped or not client.ready() or msg.WhichOneof("kind") != "chunk":
                return False
            delta = out.add(msg.chunk)
            if pr.first_dispatched_at is None and out.ids:
                pr.first_dispatched_at, pr.first_leg = dispatched_at, leg
            if delta is not None and (delta.text or delta.token_ids):
                client.write(delta)
            if out.stopped:
                leg.wake()
            return True

        sink = take if client is not None else None
        leg: PdAttempt | ColocatedAttempt
        if plan.prefill is not None:
            leg = PdAttempt(node_req, plan.prefill, plan.prefill_rank, plan.worker, plan.rank, plan.room,
                            req.deadline, self.aborter, sink)
        else:
            if plan.worker.dp_size > 1:
                node_req.dp_rank = plan.rank
            leg = ColocatedAttempt(node_req, plan.worker, req.deadline, self.aborter, sink)
        fin: worker_pb2.Finished | None = None
        async with contextlib.aclosing(leg.stream()) as msgs:
            async for msg in msgs:
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    delta = out.add(msg.chunk)
                elif kind == "finished":
                    fin = msg.finished
                    if fin.finish_reason == "abort":
                        raise LegError(f"the {plan.worker.role} worker aborted the request", grpc.StatusCode.ABORTED,
                                       plan.worker.address, True)
                    delta = out.add(fin.last, final=True)
                else:  # the sink's wake-up (``legs.WAKE``): it took a chunk that matched a stop string
                    delta = None
                if pr.first_dispatched_at is None and out.ids:
                    pr.first_dispatched_at, pr.first_leg = dispatched_at, leg
                if req.stream and delta is not None and (delta.text or delta.token_ids):
                    yield delta
                if out.stopped:
                    break  # closing the legs aborts them on both nodes
        if not out.ids:
            raise LegError("the request finished without producing a token", grpc.StatusCode.INTERNAL,
                           plan.worker.address, True)
        for lease in plan.leases:
            lease.worker.breaker.record_success()
        yield self.final(req, pr, fin, plan, pr.attempt + 1)

    def final(self, req: GenRequest, pr: Progress, fin: worker_pb2.Finished | None, plan: Plan,
              attempts: int) -> Final:
        """The request's Final (``fin``: the last attempt's Finished; None when the router ended the request)."""
        assert pr.first_dispatched_at is not None  # a token was produced
        final = pr.out.finish(fin, _prefill_resp(pr.first_leg), plan.served_by, attempts, pr.first_dispatched_at,
                              pr.migrations)
        self.timings.put(req.rid, {**final.timing, "served_by": final.served_by})
        return final


def _prefill_resp(leg: PdAttempt | ColocatedAttempt | None) -> worker_pb2.PrefillResponse | None:
    """P's answer for a PD attempt (read at the end: D may stream before P's RPC returns)."""
    return leg.prefill_resp if isinstance(leg, PdAttempt) else None
