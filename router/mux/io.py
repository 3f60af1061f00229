"""The two carriers of a Mux stream's frames: its ``Worker.Mux`` gRPC call (``GrpcMuxIO``) or a Mux socket
(``SocketMuxIO``, ``common/wire/mux_socket.py``). Each calls ``on_frame`` per frame received and ``on_end`` once, with
the error that ends every request on the stream. ``rpc_error`` makes the ``grpc.aio.AioRpcError`` those requests see.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from common.wire.mux_socket import FrameConnection, FrameError
from pdcluster.v1 import worker_pb2

logger = logging.getLogger(__name__)

KEEPALIVE_IDLE_S = 10.0  # a Mux socket silent this long is pinged ... (as CHANNEL_OPTIONS' gRPC keepalive)
KEEPALIVE_TIMEOUT_S = 5.0  # ... and fails when nothing arrives within this after the ping


def rpc_error(code: grpc.StatusCode, details: str, trailing: Any = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)



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
