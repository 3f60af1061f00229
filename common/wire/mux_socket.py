"""The Mux socket: ``Worker.Mux``'s stream on a plain (or TLS) TCP connection, framed as a 4-byte big-endian length
and a serialized ``MuxFrame`` (see ``proto/pdcluster/v1/worker.proto``, rpc Mux).

Why: grpc.aio's stream write was the largest single cost in the router's CPU per request (two legs, each a frame
each way), where a transport write of the same bytes is one syscall (benchmarks/pages/router_overhead.md). The gRPC
Mux stream stays the way a router learns of the socket (its initial metadata) and the fallback when the socket cannot
be reached.

Invariants: a connection delivers frames in order, each exactly once, until it is lost; ``on_lost`` is called
exactly once; a frame over ``MAX_FRAME_BYTES`` or one that does not parse loses the connection (the peer is not
speaking this protocol; a node lowers the bound to a few KB until the hello). A node serves requests on a connection only after its hello carried the credential.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from common.wire.mux_frames import FRAME_BYTES
from pdcluster.v1 import worker_pb2

logger = logging.getLogger(__name__)

SOCKET_METADATA_KEY = "pdcluster-mux-socket"  # the port, in a Mux stream's initial metadata
HELLO_TIMEOUT_S = 5.0  # for the router's hello on a new connection, and for the node's answer
MAX_FRAME_BYTES = FRAME_BYTES + (256 << 10)  # a frame's messages stop at FRAME_BYTES; room for their envelopes
# A host that stops answering (gone, partitioned) loses the connection within about 15 s at the TCP level: idle
# probes, and a bound on unacknowledged data. (A stopped process whose kernel still answers is the router's
# application-level keepalive's job: router/mux.py SocketMuxIO.)
TCP_OPTIONS = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 1), ("TCP_USER_TIMEOUT", 15_000))
_HEADER = struct.Struct(">I")


class FrameError(ConnectionError):
    """The peer sent something that is not a Mux frame."""


def tune_socket(sock: socket.socket | None) -> None:
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in TCP_OPTIONS:
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class FrameConnection(asyncio.Protocol):
    """One Mux socket connection, either end: ``write`` sends a frame (waiting while the peer's window is full),
    ``on_frame`` receives each parsed frame, ``on_lost`` the reason the connection ended (None: closed cleanly)."""

    def __init__(self) -> None:
        self.on_frame: Callable[[worker_pb2.MuxFrame], None] = lambda _f: None
        self.on_lost: Callable[[BaseException | None], None] = lambda _e: None
        self.on_made: Callable[[], None] = lambda: None  # after the transport and peer are known
        self.max_frame_bytes = MAX_FRAME_BYTES  # a node lowers it until the hello is accepted
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.lost = False
        self._buf = bytearray()  # the start of a frame not yet whole
        self._need = 4  # bytes _buf must hold before a frame can be parsed from it
        self._paused: asyncio.Future[None] | None = None  # set while the transport's write buffer is over its mark
        self._made: asyncio.Future[None] | None = None  # a wait_made() waiting

    # -- asyncio.Protocol ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  (uvloop's transports do not subclass asyncio's)
        tune_socket(transport.get_extra_info("socket"))
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.on_made()
        if self._made is not None and not self._made.done():
            self._made.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        if buf:
            buf += data
            if len(buf) < self._need:  # a large frame arriving in pieces is joined once, when whole
                return
            data = bytes(buf)
            del buf[:]
        start, end = 0, len(data)
        try:
            while end - start >= 4:
                (n,) = _HEADER.unpack_from(data, start)
                if n > self.max_frame_bytes:
                    raise FrameError(f"a Mux frame of {n} bytes (at most {self.max_frame_bytes})")
                if end - start - 4 < n:
                    self._need = 4 + n
                    break
                frame = worker_pb2.MuxFrame.FromString(data[start + 4 : start + 4 + n])
                start += 4 + n
                if self.lost:
                    return
                self.on_frame(frame)
        except Exception as e:  # a malformed frame, or a receiver bug: the connection cannot be trusted any more
            self._lose(e if isinstance(e, ConnectionError) else FrameError(f"a bad Mux frame: {e!r}"))
            return
        if start < end:  # an incomplete frame waits for the rest
            if end - start < 4:
                self._need = 4
            buf += data[start:]

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(exc)

    def pause_writing(self) -> None:
        if self._paused is None:
            self._paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._paused is not None:
            if not self._paused.done():
                self._paused.set_result(None)
            self._paused = None

    # -- use ------------------------------------------------------------------------------------------------------
    async def wait_made(self) -> None:
        """Until connection_made (or the loss): uvloop may call it after create_connection has returned."""
        if self.transport is None and not self.lost:
            self._made = asyncio.get_running_loop().create_future()
            await self._made

    async def write(self, frame: worker_pb2.MuxFrame) -> None:
        if self.lost or self.transport is None:
            raise ConnectionError(f"the Mux socket to {self.peer} is closed")
        self.send_now(frame)
        while self._paused is not None:
            await self._paused
            if self.lost:
                raise ConnectionError(f"the Mux socket to {self.peer} was lost")

    def send_now(self, frame: worker_pb2.MuxFrame) -> None:
        """Queue ``frame`` on the transport without waiting for the peer's window (a handshake's one frame)."""
        if not self.lost and self.transport is not None:
            data = frame.SerializeToString()
            self.transport.write(_HEADER.pack(len(data)) + data)

    def close(self) -> None:
        """Drop the connection now (what is still queued is not sent); ``on_lost`` gets None."""
        if self.transport is not None:
            self.transport.abort()
        self._lose(None)

    def _lose(self, exc: BaseException | None) -> None:
        if self.lost:
            return
        self.lost = True
        self._buf = bytearray()  # a partial frame is not kept alive by whoever still holds this connection
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        if self._made is not None and not self._made.done():
            self._made.set_result(None)
        self.on_lost(exc)


def hello_frame(credential: str = "") -> worker_pb2.MuxFrame:
    return worker_pb2.MuxFrame(messages=[worker_pb2.MuxMessage(stream_id=0, hello=worker_pb2.MuxHello(
        credential=credential))])


async def connect(host: str, port: int, credential: str, ssl: Any = None, server_hostname: str | None = None,
                  timeout: float = HELLO_TIMEOUT_S) -> FrameConnection:
    """Router side: a connection whose hello the node accepted. Raises ``ConnectionError`` (refused, unreachable,
    TLS failure, refused hello) or ``TimeoutError``."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[worker_pb2.MuxFrame] = loop.create_future()

    def first(frame: worker_pb2.MuxFrame) -> None:
        if not answer.done():
            answer.set_result(frame)

    def lost(exc: BaseException | None) -> None:
        if not answer.done():
            answer.set_exception(ConnectionError(f"the Mux socket {host}:{port} closed during its hello ({exc!r})"))

    conn = FrameConnection()
    conn.on_frame, conn.on_lost = first, lost
    try:
        async with asyncio.timeout(timeout):
            await loop.create_connection(lambda: conn, host, port, ssl=ssl,
                                         server_hostname=server_hostname if ssl is not None else None)
            await conn.wait_made()
            await conn.write(hello_frame(credential))
            frame = await answer
    except BaseException:
        conn.close()
        if answer.done() and not answer.cancelled():
            answer.exception()  # retrieved: the error raised here says it
        raise
    kinds = [m.WhichOneof("kind") for m in frame.messages]
    if kinds != ["hello"]:
        conn.close()
        st = frame.messages[0].status if kinds and kinds[0] == "status" else None
        raise ConnectionError(f"the Mux socket {host}:{port} refused the hello: "
                              f"{st.message if st is not None else kinds}")
    conn.on_frame, conn.on_lost = (lambda _f: None), (lambda _e: None)
    return conn
