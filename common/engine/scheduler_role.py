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

The role is handed to the scheduler (``Scheduler(args, ..., role=PrefillRole(args))``), which calls
``role.bind(engine)`` once it has built its pools: the role then builds what it needs of them (KV manager, queues)
and from then on calls only the ``Engine`` interface below, never the scheduler's other attributes.

The colocated engine is the role with empty hooks (``ColocatedRole``, on ``LoopHooks``); the prefill node's role sends KV pages and
keeps a finished request's pages until its transfer is done; the decode node's role feeds transferred requests
into the running batch from ``poll``. A role never replays the loop: it holds its queues and these hooks only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from common.engine.io_struct import GenerateReqInput, QueueLoad
from common.engine.req import Req
from common.engine.scheduler_metrics import NO_DISAGG_QUEUES, DisaggQueueCounts
from common.errors import ErrorCode

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.decode_manager import DecodeManager
    from common.engine.distributed import TPGroup
    from common.engine.mem.allocator import TokenToKVPoolAllocator
    from common.engine.mem.radix_cache import BasePrefixCache
    from common.engine.mem.req_to_token_pool import ReqToTokenPool
    from common.engine.model_runner import ModelRunner
    from common.engine.prefill_manager import PrefillManager
    from common.engine.request_intake import RequestIntake
    from common.engine.scheduler_output import OutputCollector


class Engine(Protocol):
    """What a role may use of the scheduler that holds it (``common.engine.scheduler.Scheduler``): its collaborators
    and the owners of its queues (references fixed at construction), and the request operations that span them."""

    args: ServerArgs
    dp_rank: int
    tp: TPGroup
    tokenizer: Any
    runner: ModelRunner  # its KV pool is what a role's KV manager registers
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    tree_cache: BasePrefixCache  # the prefix cache every release goes through (a decode node shares prompts in it)
    intake: RequestIntake  # build_req (validate, register), find (a request in flight by rid)
    out: OutputCollector  # error (answer a request not taken in), send_now (a role's own reports)
    prefill: PrefillManager  # the waiting queue: enqueue, take_waiting, num_waiting, prefilling_reqs
    decode: DecodeManager  # the running batch, and the speculator (P/D: what the drafter hands prefill -> decode)

    def add_prebuilt(self, reqs: list[Req], take_first_token: Callable[[Req], None]) -> None:
        """Requests whose prompt KV and first token were computed elsewhere join the running batch."""
        ...

    def preempt_running(self, victims: list[Req], head: Req) -> None:
        """Priority preemption for ``head`` (a role's queued request): ``victims`` leave the running batch, their KV
        released (allocatable once no batch in flight can write it), and wait from the next step to recompute."""
        ...

    def abort_request(self, rid: str, reason: str) -> None:
        """A waiting request leaves at once; one in a batch finishes as ABORT at its next result."""
        ...

    def finish_req(self, req: Req, release: bool = True) -> None:
        """The one finish path: release (or cache) the request's KV and report its outcome."""
        ...

    def log_request_end(self, req: Req, outcome: str) -> None:
        ...


class SchedulerRole(Protocol):
    def bind(self, engine: Engine) -> None:
        """Called once by the scheduler that holds the role, after its pools exist: build what the role needs of
        them (KV manager, queues)."""
        ...

    def is_idle(self) -> bool:
        """No request in the role's own queues."""
        ...

    def close(self) -> None:
        """Release what ``bind`` built (KV manager, sockets); the scheduler calls it from its own ``close``."""
        ...

    def admit(self, msg: GenerateReqInput) -> None:
        """Take a new request in: validate it (``engine.intake.build_req``) and put it where it waits first."""
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
    """The colocated engine: requests wait in the prefill manager's waiting queue; every loop hook is empty."""

    def __init__(self, args: ServerArgs | None = None) -> None:
        self.engine: Engine | None = None

    def bind(self, engine: Engine) -> None:
        self.engine = engine

    def is_idle(self) -> bool:
        return True

    def close(self) -> None:
        """Nothing of its own."""

    def admit(self, msg: GenerateReqInput) -> None:
        assert self.engine is not None
        req = self.engine.intake.build_req(msg)
        if req is not None:
            self.engine.prefill.enqueue([req])

    def abort(self, rid: str, reason: str, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        assert self.engine is not None
        self.engine.abort_request(rid, reason)

    def fill_load(self, load: QueueLoad) -> None:
        """No queues beyond the waiting queue."""

    def queue_counts(self) -> DisaggQueueCounts:
        return NO_DISAGG_QUEUES
