"""The router's end of ``Worker.Mux``: one long-lived stream per worker carrying every request's legs.

A ``MuxCall`` reads like the per-request ``grpc.aio`` call it replaces (``read`` returns messages then
``grpc.aio.EOF``; failures raise ``grpc.aio.AioRpcError`` with the node's code, message and trailing metadata;
``cancel`` makes a pending ``read`` raise ``CancelledError``), so the attempt code and its error mapping are shared.
A call may also have a ``sink``: a function that takes the node's messages as they arrive, in the frame's callback,
instead of waking the reader's task for each (a streamed token costs no task wake-up; ``router/attempts/run.py``).

Invariants: a call is in ``MuxStream.calls`` from its open until its terminal item (status, local deadline,
cancel, or the stream's end) and gets exactly one terminal item; the sink is offered a message only while the reader
waits with nothing queued, so every message before it was read and handled, and the order holds across the two; a
stream that ends fails exactly the calls still on it, with UNAVAILABLE (or the stream's own error code), and is never
reused: the next request opens a new one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from common.wire.mux_frames import FrameWriter, Reassembler
from pdcluster.v1 import worker_pb2
from router.mux.io import GrpcMuxIO, SocketMuxIO, rpc_error

logger = logging.getLogger(__name__)

LOAD_HEARTBEAT_S = 2.0  # a watched node pushes its load at least this often, changed or not
_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
_CANCELLED = grpc.StatusCode.CANCELLED.value[0]
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


class MuxCall:
    """One request's leg on a Mux stream."""

    __slots__ = ("_items", "_timer", "_waiter", "done", "sid", "sink", "stream")

    def __init__(self, stream: MuxStream, sid: int) -> None:
        self.stream, self.sid = stream, sid
        self._items: deque[Any] = deque()  # messages, then one terminal: EOF or an exception instance
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.done = False  # the terminal item was delivered
        # Offered each node message while the reader waits; True: taken (the reader never sees it). Never a
        # terminal item. A sink that raises ends this call (INTERNAL), not the stream.
        self.sink: Callable[[Any], bool] | None = None

    def _deliver(self, msg: Any) -> None:
        w = self._waiter
        if self.sink is not None and w is not None and not w.done() and not self._items:
            try:
                if self.sink(msg):
                    return
            except Exception as e:
                logger.exception("Mux stream to %s: the sink of request %d failed", self.stream.address, self.sid)
                self.cancel(_CANCELLED, rpc_error(grpc.StatusCode.INTERNAL, f"the router failed to stream it: {e!r}"))
                return
        self.push(msg)

    def push(self, item: Any) -> None:
        """Queue ``item`` for the reader (past the sink) and wake it."""
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _end(self, item: Any) -> None:
        if self.done:
            return
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
        self.stream.calls.pop(self.sid, None)
        self.push(item)

    async def read(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item = self._items[0]
        if item is grpc.aio.EOF or isinstance(item, BaseException):
            if isinstance(item, BaseException):
                raise item.with_traceback(None)
            return item
        return self._items.popleft()

    async def result(self) -> Any:
        """The unary answer (Prefill): the first message."""
        item = await self.read()
        if item is grpc.aio.EOF:
            raise rpc_error(grpc.StatusCode.INTERNAL, "the worker ended the call without a response")
        return item

    def __await__(self) -> Any:
        return self.result().__await__()

    def cancel(self, code: int = _CANCELLED, error: BaseException | None = None) -> bool:
        """Cancel this request only: a cancel frame to the node; a pending ``read`` raises ``error`` (default
        CancelledError)."""
        if self.done:
            return False
        self.stream.writer.send(worker_pb2.MuxMessage(stream_id=self.sid, cancel=worker_pb2.MuxCancel(code=code)))
        self._end(error if error is not None else asyncio.CancelledError())
        return True

    def _expire(self) -> None:
        if self.done:
            return
        self.stream.writer.send(worker_pb2.MuxMessage(stream_id=self.sid, cancel=worker_pb2.MuxCancel(code=_DEADLINE)))
        self._end(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))


class MuxStream:
    """One open Mux stream (a gRPC call or a socket) and the requests it carries."""

    def __init__(self, io: GrpcMuxIO | SocketMuxIO, address: str,
                 on_load: Callable[[worker_pb2.GetLoadResponse], None] | None = None,
                 load_interval_s: float = 0.0) -> None:
        self.io, self.address = io, address
        self.on_load = on_load  # the node's pushed load reports (stream_id 0), when watched
        self.calls: dict[int, MuxCall] = {}
        self.next_sid = 1
        self.alive = True
        self.parts = Reassembler()
        self.loop = asyncio.get_running_loop()
        self.load_at: float | None = None  # loop time of the last pushed load report
        self.writer = FrameWriter(io.write, self._broken)
        io.start(self._receive_frame, self._fail_all)
        if on_load is not None and load_interval_s > 0:
            self.writer.send(worker_pb2.MuxMessage(stream_id=0, watch_load=worker_pb2.MuxWatchLoad(
                interval_s=load_interval_s, heartbeat_s=LOAD_HEARTBEAT_S)))

    @property
    def transport(self) -> str:
        return "socket" if isinstance(self.io, SocketMuxIO) else "grpc"

    def open(self, kind: str, request: Any, timeout: float) -> MuxCall:
        sid = self.next_sid
        self.next_sid += 1
        c = MuxCall(self, sid)
        self.calls[sid] = c
        msg = worker_pb2.MuxMessage(stream_id=sid, timeout_s=timeout)
        getattr(msg, kind).CopyFrom(request)
        self.writer.send(msg)
        c._timer = self.loop.call_later(timeout, c._expire)
        return c

    def _receive_frame(self, frame: worker_pb2.MuxFrame) -> None:
        for msg in frame.messages:
            self._receive(msg)

    def _receive(self, msg: worker_pb2.MuxMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "response":  # a streamed token's way: first and short
            c = self.calls.get(msg.stream_id)
            if c is not None:
                c._deliver(msg.response)
            return
        whole = self.parts.whole(msg) if kind == "fragment" else msg
        if whole is None:
            return
        if whole is not msg:
            kind = whole.WhichOneof("kind")
        if kind == "load":
            self.load_at = self.loop.time()
            if self.on_load is not None:
                self.on_load(whole.load)
            return
        c = self.calls.get(whole.stream_id)
        if c is None:
            return  # already ended here (cancelled, expired): the node's late messages are dropped
        if kind == "response":
            c._deliver(whole.response)
        elif kind == "prefill_done":
            c._deliver(whole.prefill_done)
        elif kind == "status":
            st = whole.status
            if st.code == 0:
                c._end(grpc.aio.EOF)
            else:
                code = _BY_VALUE.get(st.code, grpc.StatusCode.UNKNOWN)
                c._end(rpc_error(code, st.message, tuple(st.trailing_metadata.items())))

    def _broken(self, e: BaseException) -> None:
        self._fail_all(rpc_error(grpc.StatusCode.UNAVAILABLE, f"Mux stream to {self.address} broke: {e!r}"))

    def _fail_all(self, err: grpc.aio.AioRpcError) -> None:
        if not self.alive:
            return
        self.alive = False
        calls = list(self.calls.values())
        if calls:
            logger.warning("Mux stream to %s ended (%s); failing its %d requests", self.address, err.code().name,
                           len(calls))
        for c in calls:
            c._end(err)
        self.writer.close()
        self.io.close()

    def close(self) -> None:
        self._fail_all(rpc_error(grpc.StatusCode.UNAVAILABLE, f"Mux stream to {self.address} was closed"))
