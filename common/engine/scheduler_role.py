"""``SchedulerRole``: what a node's role adds to the one engine loop, asked at fixed points of ``Scheduler.step``.

The loop (``common.engine.scheduler``) and where it asks the role::

    step:  role.begin_step()                      snapshot the transfers this step acts on (a TP collective)
           process_input_requests                 role.admit / role.abort / role.fill_load per message
           role.poll()                            move the role's queues forward, before batch selection
           get_next_batch_to_run                  merge: the chunked request is cached -> role.on_chunk_done(req)
           run (overlap: role.waits_for_forward() first)
           process_batch_result                   middle chunk  -> role.chunk_stop(req)
                                                  prompt done   -> role.on_prefill_done(req)
           finish_req                             role.keep_pages_on_finish(req), role.on_finish(req)

The colocated engine is the role with empty hooks (``ColocatedRole``, on ``LoopHooks``); the prefill node's role sends KV pages and
keeps a finished request's pages until its transfer is done; the decode node's role feeds transferred requests
into the running batch from ``poll``. A role never replays the loop: it holds its queues and these hooks only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from common.engine.req import Req
from common.engine.scheduler_metrics import NO_DISAGG_QUEUES, DisaggQueueCounts
from common.errors import ErrorCode
from common.io_struct import GenerateReqInput, QueueLoad

if TYPE_CHECKING:
    from common.engine.scheduler import Scheduler


class SchedulerRole(Protocol):
    def admit(self, msg: GenerateReqInput) -> None:
        """Take a new request in: validate it (``Scheduler.build_req``) and put it where it waits first."""
        ...

    def abort(self, rid: str, reason: str, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        """Abort a request wherever it is; one in a batch finishes as ABORT at its next result. ``code`` says why
        (CANCELLED: the client went; DEADLINE_EXCEEDED: its deadline passed) to the KV peer."""
        ...

    def fill_load(self, load: QueueLoad) -> None:
        """Add the role's queue lengths to a load report."""
        ...

    def queue_counts(self) -> DisaggQueueCounts:
        """The role's queue lengths for the ``Prefill batch.`` / ``Decode batch.`` log lines."""
        ...

    def begin_step(self) -> None:
        """First thing in a step, before its inputs: snapshot every transfer the step may act on. Every TP rank
        calls it at the same point with the same requests (it may be a collective)."""
        ...

    def poll(self) -> None:
        """After the inputs, before batch selection: move the role's queues forward (requests ready to run join
        the waiting queue or the running batch; failed and transferred ones finish through ``finish_req``)."""
        ...

    def waits_for_forward(self) -> bool:
        """Overlap schedule: whether the previous forward must have finished before the next batch is prepared
        (the role reads its KV pages outside the forward thread in ``on_chunk_done``)."""
        ...

    def on_chunk_done(self, req: Req) -> None:
        """The chunked request's pages computed so far are in the prefix cache (after ``cache_unfinished_req``,
        which may have replaced its slots by the cache's copies), before its next chunk is scheduled."""
        ...

    def chunk_stop(self, req: Req) -> tuple[str, ErrorCode] | None:
        """A middle chunk's result is in: why the request must stop before its next chunk (message, status), or
        None. The engine stops an aborted request (``to_abort``) itself when this returns None."""
        ...

    def on_prefill_done(self, req: Req) -> None:
        """The request's prompt is computed and its first token appended (it may have finished with it)."""
        ...

    def keep_pages_on_finish(self, req: Req) -> bool:
        """A request holding pages finishes: True if something outside the forward may still read them (a KV
        transfer). The role then holds the request and calls ``finish_req`` again once they may go."""
        ...

    def on_finish(self, req: Req) -> bool:
        """The request has left the engine (pages released or kept): True if the role reported its outcome
        itself; False, the engine streams its final ``TokenOut``."""
        ...


class LoopHooks:
    """The loop's hooks, empty: a role with no transfers (colocated, decode) overrides only what it adds."""

    def begin_step(self) -> None:
        """No transfers to snapshot."""

    def poll(self) -> None:
        """No queues of its own to move."""

    def waits_for_forward(self) -> bool:
        return False

    def on_chunk_done(self, req: Req) -> None:
        """Nothing reads the pages outside the forward."""

    def chunk_stop(self, req: Req) -> tuple[str, ErrorCode] | None:
        return None

    def on_prefill_done(self, req: Req) -> None:
        """The request goes on decoding."""

    def keep_pages_on_finish(self, req: Req) -> bool:
        return False

    def on_finish(self, req: Req) -> bool:
        return False


class ColocatedRole(LoopHooks):
    """The colocated engine: requests wait in the scheduler's waiting queue; every loop hook is empty."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def admit(self, msg: GenerateReqInput) -> None:
        req = self.scheduler.build_req(msg)
        if req is not None:
            self.scheduler.waiting_queue.append(req)

    def abort(self, rid: str, reason: str, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        self.scheduler.abort_request(rid, reason)

    def fill_load(self, load: QueueLoad) -> None:
        """No queues beyond the waiting queue."""

    def queue_counts(self) -> DisaggQueueCounts:
        return NO_DISAGG_QUEUES
