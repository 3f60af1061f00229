"""``Worker.Mux`` served on top of a Worker servicer's own per-request handlers (``Generate``, ``Prefill``,
``Decode``): a servicer gets Mux by inheriting ``MuxServing``, and each multiplexed request runs exactly the code its
per-request RPC runs, against a ``MuxCallContext`` standing in for the RPC's ``ServicerContext``.

Invariants: every request opened on the stream gets exactly one ``status`` (its last message) unless the stream
ended first; a cancel frame (or the request's own deadline) cancels only that request's handler task, as a
cancelled RPC would, with the cancel's code readable by the handler (``cancel_code``); the stream ending cancels
every handler still running on it (code CANCELLED). A streaming handler may send a response through its context's
``sink`` instead of yielding it, only while the handler waits with nothing pending, so the order holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Callable
from functools import partial
from typing import Any

import grpc

from common.wire.mux_frames import MUX_METADATA_KEY, FrameWriter, Reassembler
from common.wire.mux_socket import SOCKET_METADATA_KEY
from pdcluster.v1 import worker_pb2

logger = logging.getLogger(__name__)

_HANDLERS = {"generate": "Generate", "prefill": "Prefill", "decode": "Decode"}
_UNARY = frozenset({"prefill"})
LOAD_ERROR_LOG_S = 30.0  # a failing load report is logged at most this often per stream


class MuxAbort(Exception):
    """What ``MuxCallContext.abort`` raises: ends the handler with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class MuxCallContext:
    """The part of ``grpc.aio.ServicerContext`` the per-request handlers use, for one multiplexed request."""

    __slots__ = ("_deadline", "_outer", "cancel_code", "sink", "trailing")

    def __init__(self, outer: grpc.aio.ServicerContext, deadline: float | None) -> None:
        self._outer = outer
        self._deadline = deadline  # loop time, or None
        self.trailing: tuple[tuple[str, str], ...] = ()
        self.cancel_code: grpc.StatusCode | None = None  # set when the request was cancelled (client or deadline)
        # A streaming request's response sent at once (``WorkerServicer.stream_tokens``): what the handler would
        # yield, written without waking its task. None on a unary request.
        self.sink: Callable[[worker_pb2.GenerateResponse], None] | None = None

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise MuxAbort(code, details)

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        self.trailing = tuple(trailing_metadata)

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(self._deadline - asyncio.get_running_loop().time(), 0.0)

    def cancelled(self) -> bool:
        return self.cancel_code is not None

    def invocation_metadata(self) -> Any:
        return self._outer.invocation_metadata()

    def peer(self) -> str:
        return self._outer.peer()


class MuxSession:
    """One Mux stream on the node: requests by stream_id, their handler tasks, the batched writer."""

    def __init__(self, servicer: Any, context: grpc.aio.ServicerContext) -> None:
        self.servicer, self.context = servicer, context
        self.tasks: dict[int, tuple[asyncio.Task[None], MuxCallContext]] = {}
        self.parts = Reassembler()
        self.writer = FrameWriter(context.write, self._write_failed)
        self.loop = asyncio.get_running_loop()
        self.load_pusher: asyncio.Task[None] | None = None
        self.opened = 0  # requests opened on this stream (the load pusher reports after any)

    def _write_failed(self, e: BaseException) -> None:
        logger.info("Mux stream write failed (%r); cancelling its %d requests", e, len(self.tasks))
        self.cancel_all()

    def receive(self, msg: worker_pb2.MuxMessage) -> None:
        whole = self.parts.whole(msg)
        if whole is None:
            return
        kind = whole.WhichOneof("kind")
        sid = whole.stream_id
        if kind == "watch_load":
            if self.load_pusher is not None:
                self.load_pusher.cancel()
                self.load_pusher = None
            w = whole.watch_load
            if w.interval_s > 0:
                self.load_pusher = self.loop.create_task(self._push_load(w.interval_s, max(w.heartbeat_s, w.interval_s)))
        elif kind == "ping":  # the router's keepalive on a Mux socket: answered at once, ahead of queued frames
            self.writer.send_first(whole)
        elif kind == "cancel":
            deadline_passed = whole.cancel.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            self.cancel(sid, grpc.StatusCode.DEADLINE_EXCEEDED if deadline_passed else grpc.StatusCode.CANCELLED)
        elif kind in _HANDLERS:
            if sid in self.tasks:
                self.writer.send(_status(sid, grpc.StatusCode.INVALID_ARGUMENT,
                                         f"stream_id {sid} is already open on this Mux stream"))
                return
            deadline = self.loop.time() + whole.timeout_s if whole.timeout_s > 0 else None
            ctx = MuxCallContext(self.context, deadline)
            if kind not in _UNARY:
                ctx.sink = partial(self._respond, sid)
            self.opened += 1
            task = self.loop.create_task(self._run(sid, kind, getattr(whole, kind), ctx))
            self.tasks[sid] = (task, ctx)
            if deadline is not None:
                timer = self.loop.call_at(deadline, self.cancel, sid, grpc.StatusCode.DEADLINE_EXCEEDED)
                task.add_done_callback(lambda _t: timer.cancel())
        else:
            logger.warning("Mux: ignoring a %r message from the router (stream_id %d)", kind, sid)

    def cancel(self, sid: int, code: grpc.StatusCode) -> None:
        entry = self.tasks.get(sid)
        if entry is not None and entry[1].cancel_code is None:
            entry[1].cancel_code = code
            entry[0].cancel()

    def cancel_all(self) -> None:
        for sid in list(self.tasks):
            self.cancel(sid, grpc.StatusCode.CANCELLED)

    async def _push_load(self, interval_s: float, heartbeat_s: float) -> None:
        """Every ``interval_s``: the node's load (the servicer's own ``GetLoad``) when it changed, when requests were
        opened since the last push (a router's reservations for them end at a report), or ``heartbeat_s`` after the
        last push. A round whose ranks do not answer in time is skipped."""
        last, last_at, opened = b"", -1e9, self.opened
        logged_at = -1e9
        while True:
            await asyncio.sleep(interval_s)
            try:
                load = await self.servicer.GetLoad(worker_pb2.GetLoadRequest(), MuxCallContext(self.context, None))
            except MuxAbort:
                continue
            except Exception:  # a failed round must not end the pushes (the router would fall back to polling)
                if self.loop.time() - logged_at >= LOAD_ERROR_LOG_S:
                    logged_at = self.loop.time()
                    logger.exception("Mux: a load report failed; skipping the round")
                continue
            data = load.SerializeToString(deterministic=True)
            now = self.loop.time()
            if data != last or self.opened != opened or now - last_at >= heartbeat_s:
                self.writer.send(worker_pb2.MuxMessage(stream_id=0, load=load))
                last, last_at, opened = data, now, self.opened

    def _respond(self, sid: int, item: worker_pb2.GenerateResponse) -> None:
        self.writer.send(worker_pb2.MuxMessage(stream_id=sid, response=item))

    async def _run(self, sid: int, kind: str, request: Any, ctx: MuxCallContext) -> None:
        handler = getattr(self.servicer, _HANDLERS[kind])
        code, details = grpc.StatusCode.OK, ""
        try:
            if kind in _UNARY:
                resp = await handler(request, ctx)
                if resp is None:
                    code, details = grpc.StatusCode.INTERNAL, f"{_HANDLERS[kind]} returned no response"
                else:
                    self.writer.send(worker_pb2.MuxMessage(stream_id=sid, prefill_done=resp))
            else:
                async for item in handler(request, ctx):
                    self.writer.send(worker_pb2.MuxMessage(stream_id=sid, response=item))
        except MuxAbort as e:
            code, details = e.code, e.details
        except asyncio.CancelledError:
            code = ctx.cancel_code or grpc.StatusCode.CANCELLED
            details = "Deadline Exceeded" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "Cancelled"
        except Exception as e:  # a handler bug: the request fails as an RPC with an unhandled exception would
            logger.exception("Mux: %s handler failed for stream_id %d", _HANDLERS[kind], sid)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}"
        finally:
            self.tasks.pop(sid, None)
            self.parts.forget(sid)
        self.writer.send(_status(sid, code, details, ctx.trailing))

    async def serve(self, requests: AsyncIterable[worker_pb2.MuxFrame]) -> None:
        try:
            async for frame in requests:
                self.receive_frame(frame)
        finally:
            await self.finish()

    def receive_frame(self, frame: worker_pb2.MuxFrame) -> None:
        for msg in frame.messages:
            self.receive(msg)

    async def finish(self) -> None:
        """The stream ended: cancel every handler still running on it and wait (bounded) for them to end."""
        if self.load_pusher is not None:
            self.load_pusher.cancel()
        self.cancel_all()
        running = [t for t, _ in self.tasks.values()]
        if running:
            await asyncio.wait(running, timeout=5.0)
        self.writer.close()


def _status(sid: int, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> Any:
    st = worker_pb2.MuxStatus(code=code.value[0], message=details)
    for key, value in trailing:
        st.trailing_metadata[key] = str(value)
    return worker_pb2.MuxMessage(stream_id=sid, status=st)


class MuxServing:
    """Mixin for a ``WorkerServicer``: serves ``Mux`` with the class's own Generate / Prefill / Decode.
    ``mux_socket_port`` (set by whoever started a ``common.node.mux_socket_server.MuxSocketServer`` for it) is
    offered to routers in the stream's initial metadata."""

    mux_socket_port = 0  # 0: no Mux socket

    async def Mux(self, request_iterator: AsyncIterable[worker_pb2.MuxFrame],
                  context: grpc.aio.ServicerContext) -> None:
        md: tuple[tuple[str, str], ...] = ((MUX_METADATA_KEY, "1"),)  # tells the router at once: Mux is served
        if self.mux_socket_port:
            md += ((SOCKET_METADATA_KEY, str(self.mux_socket_port)),)
        await context.send_initial_metadata(md)
        await MuxSession(self, context).serve(request_iterator)
