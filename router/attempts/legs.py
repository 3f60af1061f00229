"""One attempt at serving a request: the RPC legs on the chosen workers, under one deadline and one cancel scope.

PD attempt: ``Prefill`` on P and ``Decode`` on D start together. D's stream is passed through as it arrives (the
first token is not held back until P answers); P's answer (cached tokens, timings) is awaited before the final
message. If either leg fails, the other is cancelled. Unless the attempt ended with a Finished message, both nodes
get ``Abort(rid)`` - on leg failure, on client cancel (task cancellation), on deadline, and when the consumer stops
reading early (router-side stop string). Aborts run in the background so a cancelled client is released at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from common.errors import FAULT_METADATA_KEY, KV_PEER_FAULT
from pdcluster.v1 import worker_pb2
from router.errors import RETRYABLE, LegError, scrub_internal
from router.failure_log import FailureLog
from router.fleet.worker import Worker
from router.metrics import RouterMetrics
from router.mux.io import rpc_error
from router.mux.stream import MuxCall

logger = logging.getLogger(__name__)


class Aborter:
    """Fire-and-forget ``Worker.Abort`` calls, tracked so shutdown can wait for them."""

    def __init__(self, rpc_timeout_s: float, metrics: RouterMetrics) -> None:
        self.rpc_timeout_s = rpc_timeout_s
        self.metrics = metrics
        self.pending: set[asyncio.Task[None]] = set()
        # a stalled or dead node fails every abort sent to it alike: the first logged, the repeats counted
        self.failures = FailureLog(logger, what="Abort failed", many="Abort calls")

    def abort(self, worker: Worker, rid: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(worker, rid))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _abort(self, worker: Worker, rid: str) -> None:
        self.metrics.aborts.labels(worker.role).inc()
        try:
            await worker.stub.Abort(worker_pb2.AbortRequest(rid=rid), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            self.failures.failed(rid, e.code().name, f"on {worker.address}: {e.details()}")

    async def drain(self, timeout: float) -> None:
        if self.pending:
            await asyncio.wait(list(self.pending), timeout=timeout)


def leg_error(leg: str, worker: Worker, e: grpc.aio.AioRpcError) -> LegError:
    """The client's message names the worker's role and the node's reason, scrubbed of addresses and paths (a
    node's own INVALID_ARGUMENT still says which field to fix); the raw message stays in ``internal``."""
    code, details = e.code(), e.details() or ""
    return LegError(
        f"{leg} on a {worker.role} worker failed: {code.name}: {scrub_internal(details)}",
        code,
        worker.address,
        code in RETRYABLE,
        _retry_after(e) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None,
        internal=f"{leg} on {worker.address}: {details}",
        peer_fault=(FAULT_METADATA_KEY, KV_PEER_FAULT) in tuple(e.trailing_metadata() or ()),
    )


def _retry_after(e: grpc.aio.AioRpcError) -> float | None:
    """The worker's ``retry-after-ms`` trailing metadata, in seconds."""
    for key, value in e.trailing_metadata() or ():
        if key == "retry-after-ms":
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None


_RPC_OF_KIND = {"prefill": "Prefill", "decode": "Decode", "generate": "Generate"}


async def open_leg(w: Worker, kind: str, request: Any, timeout: float) -> Any:
    """Start one leg on ``w``: on its Mux stream when it serves one, else the per-request RPC. Either way the
    result reads like a ``grpc.aio`` call. Raises ``LegError`` when the worker cannot be reached."""
    s = w.mux.stream
    if s is not None and s.alive:
        return s.open(kind, request, timeout)
    try:
        s = await w.mux.get(timeout)
    except grpc.aio.AioRpcError as e:
        raise leg_error(_RPC_OF_KIND[kind], w, e) from None
    except TimeoutError:
        raise leg_error(_RPC_OF_KIND[kind], w, rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")) from None
    if s is not None:
        return s.open(kind, request, timeout)
    return getattr(w.stub, _RPC_OF_KIND[kind])(request, timeout=timeout)


WAKE = worker_pb2.GenerateResponse()  # no kind: queued past a leg's sink to have the reader look at the request


class _Sunk:
    """An attempt whose token stream may go to a ``sink`` (``MuxCall.sink``): given the stream's messages as they
    arrive while the attempt's reader waits (Mux calls only; a per-request gRPC call is read message by message).
    ``wake`` has the reader look at the request after the sink took a message."""

    sink: Callable[[worker_pb2.GenerateResponse], bool] | None = None
    _call: Any = None  # the token stream, once open

    def _streaming(self, call: Any) -> None:
        self._call = call
        if self.sink is not None and isinstance(call, MuxCall):
            call.sink = self.sink

    def wake(self) -> None:
        if isinstance(self._call, MuxCall):
            self._call.push(WAKE)


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class PdAttempt(_Sunk):
    """Prefill on (p, p_rank) and Decode on (d, d_rank) for one bootstrap room; D's stream may go to ``sink``."""

    def __init__(
        self,
        req: worker_pb2.GenerateRequest,
        p: Worker,
        p_rank: int,
        d: Worker,
        d_rank: int,
        room: int,
        deadline: float,
        aborter: Aborter,
        sink: Callable[[worker_pb2.GenerateResponse], bool] | None = None,
    ) -> None:
        self.req, self.p, self.p_rank, self.d, self.d_rank = req, p, p_rank, d, d_rank
        self.room, self.deadline, self.aborter, self.sink = room, deadline, aborter, sink
        self.prefill_resp: worker_pb2.PrefillResponse | None = None
        self.failed_worker: Worker | None = None
        self._prefill_err: LegError | None = None

    async def stream(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        timeout = max(self.deadline - time.monotonic(), 0.001)
        p, d, rid = self.p, self.d, self.req.rid
        try:
            pcall = await open_leg(
                p, "prefill",
                worker_pb2.PrefillRequest(request=self.req, bootstrap_room=self.room, prefill_dp_rank=self.p_rank),
                timeout,
            )
        except LegError:
            self.failed_worker = p  # the request never reached a node
            raise
        try:
            dcall = await open_leg(
                d, "decode",
                worker_pb2.DecodeRequest(
                    request=self.req,
                    bootstrap_room=self.room,
                    bootstrap_addr=p.bootstrap_addr,
                    prefill_dp_rank=self.p_rank,
                    decode_dp_rank=self.d_rank,
                ),
                timeout,
            )
        except LegError:
            self.failed_worker = d
            pcall.cancel()
            self.aborter.abort(p, rid)
            raise
        self._streaming(dcall)
        ptask: asyncio.Future[worker_pb2.PrefillResponse] = asyncio.ensure_future(pcall)

        def on_prefill_done(t: asyncio.Future[worker_pb2.PrefillResponse]) -> None:
            if t.cancelled():
                return
            e = t.exception()
            if isinstance(e, grpc.aio.AioRpcError):
                self._prefill_err = leg_error("Prefill", p, e)
                dcall.cancel()  # the decode leg can never get its KV now

        ptask.add_done_callback(on_prefill_done)
        finished = False
        try:
            while True:
                try:
                    msg = await dcall.read()
                except asyncio.CancelledError:
                    if self._prefill_err is not None and not _cancelling():
                        self.failed_worker = p
                        raise self._prefill_err from None
                    raise
                except grpc.aio.AioRpcError as e:
                    self.failed_worker = d
                    raise leg_error("Decode", d, e) from None
                if msg is grpc.aio.EOF:
                    self.failed_worker = d
                    raise LegError(
                        "the decode worker ended its stream without a Finished message",
                        grpc.StatusCode.INTERNAL,
                        d.address,
                        True,
                    )
                if msg.WhichOneof("kind") == "finished":
                    self.prefill_resp = await self._prefill_result(ptask)
                    finished = True
                yield msg
                if finished:
                    return
        finally:
            if not finished:
                pcall.cancel()
                ptask.cancel()
                dcall.cancel()
                self.aborter.abort(p, rid)
                self.aborter.abort(d, rid)

    async def _prefill_result(
        self, ptask: asyncio.Future[worker_pb2.PrefillResponse]
    ) -> worker_pb2.PrefillResponse | None:
        """P's answer. Decode already finished, so a late prefill failure only costs the cached-token count."""
        if ptask.done() and not ptask.cancelled() and ptask.exception() is None:
            return ptask.result()
        try:
            return await asyncio.wait_for(asyncio.shield(ptask), max(self.deadline - time.monotonic(), 0.001))
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            logger.warning(
                "[rid=%s room=%d] decode finished but Prefill on %s did not answer: %r",
                self.req.rid,
                self.room,
                self.p.address,
                e,
            )
            return None


class ColocatedAttempt(_Sunk):
    """Generate on one colocated (mode ``null``) worker; ``req.dp_rank`` is already set; its stream may go to
    ``sink``."""

    def __init__(
        self,
        req: worker_pb2.GenerateRequest,
        w: Worker,
        deadline: float,
        aborter: Aborter,
        sink: Callable[[worker_pb2.GenerateResponse], bool] | None = None,
    ) -> None:
        self.req, self.w, self.deadline, self.aborter, self.sink = req, w, deadline, aborter, sink
        self.failed_worker: Worker | None = None

    async def stream(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        timeout = max(self.deadline - time.monotonic(), 0.001)
        try:
            call = await open_leg(self.w, "generate", self.req, timeout)
        except LegError:
            self.failed_worker = self.w
            raise
        self._streaming(call)
        finished = False
        try:
            while True:
                try:
                    msg = await call.read()
                except grpc.aio.AioRpcError as e:
                    self.failed_worker = self.w
                    raise leg_error("Generate", self.w, e) from None
                if msg is grpc.aio.EOF:
                    self.failed_worker = self.w
                    raise LegError(
                        "the worker ended its stream without a Finished message",
                        grpc.StatusCode.INTERNAL,
                        self.w.address,
                        True,
                    )
                finished = msg.WhichOneof("kind") == "finished"
                yield msg
                if finished:
                    return
        finally:
            if not finished:
                call.cancel()
                self.aborter.abort(self.w, self.req.rid)
