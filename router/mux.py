"""The router's end of ``Worker.Mux``: one long-lived stream per worker carrying every request's legs.

A ``MuxCall`` reads like the per-request ``grpc.aio`` call it replaces (``read`` returns messages then
``grpc.aio.EOF``; failures raise ``grpc.aio.AioRpcError`` with the node's code, message and trailing metadata;
``cancel`` makes a pending ``read`` raise ``CancelledError``), so the attempt code and its error mapping are shared.
A call may also have a ``sink``: a function that takes the node's messages as they arrive, in the frame's callback,
instead of waking the reader's task for each (a streamed token costs no task wake-up; ``router/core.py``).

Invariants: a call is in ``MuxStream.calls`` from its open until its terminal item (status, local deadline,
cancel, or the stream's end) and gets exactly one terminal item; the sink is offered a message only while the reader
waits with nothing queued, so every message before it was read and handled, and the order holds across the two; a
stream that ends fails exactly the calls still on it, with UNAVAILABLE (or the stream's own error code), and is never
reused: the next request opens a new one.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from common.wire.mux_frames import MUX_METADATA_KEY, FrameWriter, Reassembler
from common.wire.mux_socket import SOCKET_METADATA_KEY, FrameConnection, FrameError, connect
from common.wire.worker_auth import credential_metadata, worker_credential
from pdcluster.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 5.0  # for a node's answer (its initial metadata) to a new Mux stream
LOAD_HEARTBEAT_S = 2.0  # a watched node pushes its load at least this often, changed or not
KEEPALIVE_IDLE_S = 10.0  # a Mux socket silent this long is pinged ... (as CHANNEL_OPTIONS' gRPC keepalive)
KEEPALIVE_TIMEOUT_S = 5.0  # ... and fails when nothing arrives within this after the ping
_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
_CANCELLED = grpc.StatusCode.CANCELLED.value[0]
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


def rpc_error(code: grpc.StatusCode, details: str, trailing: Any = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


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


class GrpcMuxIO:
    """A Mux stream's frames over its ``Worker.Mux`` gRPC call."""

    def __init__(self, call: Any, address: str) -> None:
        self.call, self.address = call, address
        self.reader: asyncio.Task[None] | None = None

    def start(self, on_frame: Callable[[worker_pb2.MuxFrame], None],
              on_end: Callable[[grpc.aio.AioRpcError], None]) -> None:
        self.reader = asyncio.get_running_loop().create_task(self._read(on_frame, on_end))

    def write(self, frame: worker_pb2.MuxFrame) -> Awaitable[None]:
        return self.call.write(frame)

    async def _read(self, on_frame: Callable[[worker_pb2.MuxFrame], None],
                    on_end: Callable[[grpc.aio.AioRpcError], None]) -> None:
        err: grpc.aio.AioRpcError
        try:
            while True:
                frame = await self.call.read()
                if frame is grpc.aio.EOF:
                    err = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the worker {self.address} ended its Mux stream")
                    break
                on_frame(frame)
        except grpc.aio.AioRpcError as e:
            err = rpc_error(e.code(), f"Mux stream to {self.address} failed: {e.details()}", e.trailing_metadata())
        except asyncio.CancelledError:
            err = rpc_error(grpc.StatusCode.UNAVAILABLE, f"Mux stream to {self.address} was closed")
        except Exception as e:  # a malformed frame: the stream cannot be trusted any more
            logger.exception("Mux stream to %s: bad frame", self.address)
            err = rpc_error(grpc.StatusCode.INTERNAL, f"Mux stream to {self.address}: {e!r}")
        on_end(err)

    def close(self) -> None:
        self.call.cancel()
        if self.reader is not None:
            self.reader.cancel()


class SocketMuxIO:
    """A Mux stream's frames over a Mux socket connection (``common/wire/mux_socket.py``).

    Keepalive: a socket silent for ``KEEPALIVE_IDLE_S`` gets a ping, and fails (UNAVAILABLE, every request on it)
    when nothing arrives within ``KEEPALIVE_TIMEOUT_S`` after it: a stopped or wedged node process, whose kernel
    keeps the connection open, fails its legs as the gRPC stream's HTTP/2 keepalive would, not at their deadlines.
    """

    def __init__(self, conn: FrameConnection, address: str) -> None:
        self.conn, self.address = conn, address
        self.loop = asyncio.get_running_loop()
        self.last_rx = self.loop.time()  # loop time of the last frame received
        self.ping_at: float | None = None  # loop time of the unanswered ping
        self.seq = 0
        self._on_end: Callable[[grpc.aio.AioRpcError], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0  # loop time the next check is due

    def start(self, on_frame: Callable[[worker_pb2.MuxFrame], None],
              on_end: Callable[[grpc.aio.AioRpcError], None]) -> None:
        def frame(f: worker_pb2.MuxFrame) -> None:
            self.last_rx, self.ping_at = self.loop.time(), None
            on_frame(f)

        def lost(exc: BaseException | None) -> None:
            if isinstance(exc, FrameError):
                logger.error("Mux socket to %s: %s", self.address, exc)
                on_end(rpc_error(grpc.StatusCode.INTERNAL, f"Mux socket to {self.address}: {exc}"))
            else:
                why = f"broke: {exc!r}" if exc is not None else "was closed"
                on_end(rpc_error(grpc.StatusCode.UNAVAILABLE, f"Mux socket to {self.address} {why}"))

        self._on_end = on_end
        self.conn.on_frame, self.conn.on_lost = frame, lost
        if self.conn.lost:
            lost(ConnectionError("lost before use"))
            return
        self._schedule(self.loop.time())

    @staticmethod
    def _check_every() -> float:
        return min(KEEPALIVE_IDLE_S, KEEPALIVE_TIMEOUT_S) / 5

    def _check(self) -> None:
        now = self.loop.time()
        # A check that runs late (this loop was held up) lets the I/O that waited with it be read first: uvloop runs
        # due timers before polling sockets, so an answer already in the socket would not have been seen yet.
        late = now - self._due > self._check_every()
        if self.ping_at is not None and now - self.ping_at >= KEEPALIVE_TIMEOUT_S and not late:
            logger.warning("Mux socket to %s: no answer to a keepalive within %.1f s; failing its requests",
                           self.address, KEEPALIVE_TIMEOUT_S)
            assert self._on_end is not None
            self._on_end(rpc_error(grpc.StatusCode.UNAVAILABLE, f"the worker {self.address} did not answer a "
                                   f"keepalive within {KEEPALIVE_TIMEOUT_S:.0f} s"))
            return
        if self.ping_at is None and now - self.last_rx >= KEEPALIVE_IDLE_S:
            self.seq += 1
            self.ping_at = now
            self.conn.send_now(worker_pb2.MuxFrame(messages=[worker_pb2.MuxMessage(
                stream_id=0, ping=worker_pb2.MuxPing(seq=self.seq))]))
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        self._due = now + self._check_every()
        self._timer = self.loop.call_at(self._due, self._check)

    def write(self, frame: worker_pb2.MuxFrame) -> Awaitable[None]:
        return self.conn.write(frame)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.conn.close()


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


class MuxLink:
    """The Mux stream to one worker: opened lazily, reopened after it ends; ``supported`` False once the worker
    answered UNIMPLEMENTED (its requests then use the per-request RPCs)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, address: str, use_socket: bool = True,
                 socket_ssl: ssl.SSLContext | None = None, server_hostname: str | None = None) -> None:
        self.stub, self.address = stub, address
        # The node's Mux socket, when it offers one (else, or when it cannot be reached, the gRPC stream); TLS with
        # socket_ssl (the router's mTLS material), the node's certificate checked against server_hostname.
        self.use_socket = use_socket
        self.socket_ssl, self.server_hostname = socket_ssl, server_hostname
        self.socket_error = ""  # why the last socket attempt failed ("" after a success)
        # Set by the monitor: each stream asks the node to push its load every load_interval_s to on_load.
        self.on_load: Callable[[worker_pb2.GetLoadResponse], None] | None = None
        self.load_interval_s = 0.0
        self.supported = True
        self.stream: MuxStream | None = None
        self._opening: asyncio.Future[MuxStream | None] | None = None

    async def get(self, timeout: float) -> MuxStream | None:
        """The live stream, opening one if needed; None when the worker does not serve Mux. Raises
        ``AioRpcError`` when the worker cannot be reached (as the per-request RPC would have failed)."""
        s = self.stream
        if s is not None and s.alive:
            return s
        if not self.supported:
            return None
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
            self._opening.add_done_callback(self._opened)
        return await asyncio.wait_for(asyncio.shield(self._opening), timeout)

    def _opened(self, f: asyncio.Future[MuxStream | None]) -> None:
        self._opening = None
        if not f.cancelled() and f.exception() is None:
            self.stream = f.result()

    async def _open(self) -> MuxStream | None:
        # The credential goes on the call itself: the channel's interceptors cover only unary-request calls, and an
        # intercepted stream-request call would queue every write through an extra task. A Mux stream opens only
        # for a routable worker, one that has proven its membership.
        call = self.stub.Mux(metadata=credential_metadata())
        try:  # a node that takes the connection but never answers must not hold every request's open
            md = await asyncio.wait_for(call.initial_metadata(), OPEN_TIMEOUT_S)
        except TimeoutError:
            call.cancel()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                            f"the worker {self.address} did not open its Mux stream within {OPEN_TIMEOUT_S:.0f} s") from None
        if MUX_METADATA_KEY not in dict(md or ()):  # no stream: the call ends with its status
            code = await call.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                logger.info("worker %s does not serve Mux; using per-request RPCs", self.address)
                self.supported = False
                return None
            raise rpc_error(code, await call.details() or "the Mux stream ended at once",
                            await call.trailing_metadata() or ())
        port = dict(md).get(SOCKET_METADATA_KEY)
        if port and self.use_socket:
            conn = await self._connect(port)
            if conn is not None:
                call.cancel()
                return MuxStream(SocketMuxIO(conn, self.address), self.address, self.on_load, self.load_interval_s)
        return MuxStream(GrpcMuxIO(call, self.address), self.address, self.on_load, self.load_interval_s)

    async def _connect(self, port: str) -> FrameConnection | None:
        """The node's Mux socket, or None (logged once per failure streak) when it cannot be reached."""
        host = self.address.rsplit(":", 1)[0].strip("[]")
        try:
            conn = await connect(host, int(port), worker_credential(), self.socket_ssl,
                                 self.server_hostname or host, OPEN_TIMEOUT_S)
        except (OSError, TimeoutError, ValueError) as e:
            if not self.socket_error:
                logger.warning("worker %s: its Mux socket %s:%s cannot be used (%r); its requests stay on the gRPC "
                               "Mux stream", self.address, host, port, e)
            self.socket_error = repr(e)
            return None
        self.socket_error = ""
        return conn

    @property
    def transport(self) -> str:
        """What carries the legs now: "socket", "grpc", "rpc" (no Mux served) or "" (no stream open)."""
        if not self.supported:
            return "rpc"
        s = self.stream
        return s.transport if s is not None and s.alive else ""

    def pushed_load_age(self) -> float | None:
        """Seconds since the live stream's last pushed load report; None without a stream or a report yet."""
        s = self.stream
        if s is None or not s.alive or s.load_at is None:
            return None
        return s.loop.time() - s.load_at

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
