"""The node's Mux socket listener (``common/wire/mux_socket.py``): each accepted connection whose hello carries the
cluster credential becomes one ``MuxSession``, exactly as a ``Worker.Mux`` gRPC stream would.

Invariants: a connection serves no request before its hello was accepted, and is dropped when no hello arrives
within ``HELLO_TIMEOUT_S``; before the hello, a frame is at most ``HELLO_FRAME_BYTES`` and the connection holds a
slot of the listener's ``ConnectionBudget`` (per peer host and in all; at a bound an older connection without a
hello is closed to make room); a connection that ends (either side, or ``stop``) cancels every handler running on
it, as the gRPC stream's end does.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

import grpc

from common.node.conn_budget import HELLO_FRAME_BYTES, ConnectionBudget, Slot, peer_host
from common.node.worker_mux import MuxSession
from common.wire.mux_socket import HELLO_TIMEOUT_S, MAX_FRAME_BYTES, FrameConnection
from common.wire.security import same_secret
from common.wire.worker_auth import METADATA_KEY, REFUSED
from pdcluster.v1 import worker_pb2

logger = logging.getLogger(__name__)


def _ignore(_frame: worker_pb2.MuxFrame) -> None:
    pass


class SocketStreamContext:
    """What a ``MuxSession`` needs of its stream's ``ServicerContext``, for a Mux socket connection."""

    def __init__(self, conn: FrameConnection, credential: str) -> None:
        self.conn = conn
        self._metadata = ((METADATA_KEY, credential),)

    async def write(self, frame: worker_pb2.MuxFrame) -> None:
        await self.conn.write(frame)

    def invocation_metadata(self) -> Any:
        return self._metadata

    def peer(self) -> str:
        return f"ipv4:{self.conn.peer}"


class _Accepted:
    """One accepted connection: waits for the hello, then feeds a MuxSession."""

    def __init__(self, server: MuxSocketServer) -> None:
        self.server = server
        self.conn = FrameConnection()
        self.conn.on_frame, self.conn.on_lost = self._hello, self._lost_before_hello
        self.conn.on_made = self._made
        self.conn.max_frame_bytes = HELLO_FRAME_BYTES
        self.slot: Slot | None = None  # its hold on the server's budget until the hello
        self.session: MuxSession | None = None
        self.timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self._no_hello)

    def _made(self) -> None:
        assert self.conn.transport is not None
        self.slot = self.server.budget.admit(peer_host(self.conn.transport.get_extra_info("peername")),
                                             self.conn.close)

    def _release(self) -> None:
        if self.slot is not None:
            self.server.budget.release(self.slot)
            self.slot = None

    def _no_hello(self) -> None:
        if self.session is None:
            logger.info("Mux socket from %s: no hello within %.0f s; closed", self.conn.peer, HELLO_TIMEOUT_S)
            self.conn.close()

    def _lost_before_hello(self, _exc: BaseException | None) -> None:
        self.timer.cancel()
        self._release()
        self.server.connections.discard(self)

    def _hello(self, frame: worker_pb2.MuxFrame) -> None:
        self.timer.cancel()
        msgs = frame.messages
        presented = msgs[0].hello.credential if len(msgs) == 1 and msgs[0].WhichOneof("kind") == "hello" else None
        expected = self.server.credential
        if presented is None or (expected is not None and not same_secret(presented, expected)):
            why = REFUSED if presented is not None else "a Mux socket's first frame must be one hello"
            st = worker_pb2.MuxStatus(code=grpc.StatusCode.UNAUTHENTICATED.value[0], message=why)
            refusal = worker_pb2.MuxFrame(messages=[worker_pb2.MuxMessage(stream_id=0, status=st)])
            logger.warning("Mux socket from %s refused: %s", self.conn.peer, why)
            self.conn.on_frame = _ignore
            self.conn.send_now(refusal)
            if self.conn.transport is not None:
                self.conn.transport.close()  # after the refusal is flushed
            return
        self._release()
        self.conn.max_frame_bytes = MAX_FRAME_BYTES
        if self.server.on_hello is not None:
            self.server.on_hello(presented)
        self.session = MuxSession(self.server.servicer, SocketStreamContext(self.conn, presented))
        self.conn.on_frame, self.conn.on_lost = self.session.receive_frame, self._lost
        self.conn.send_now(worker_pb2.MuxFrame(messages=[worker_pb2.MuxMessage(stream_id=0, hello=worker_pb2.MuxHello())]))

    def _lost(self, exc: BaseException | None) -> None:
        self.server.connections.discard(self)
        if exc is not None:
            logger.info("Mux socket from %s lost: %r", self.conn.peer, exc)
        assert self.session is not None
        task = asyncio.ensure_future(self.session.finish())
        self.server.finishing.add(task)
        task.add_done_callback(self.server.finishing.discard)


class MuxSocketServer:
    """Serves ``servicer``'s Mux on ``host:port`` (0: any free port), TLS with ``ssl_context``. ``credential``: what
    a hello must present (None: anything; test fleets). ``on_hello``: told each accepted hello's credential."""

    def __init__(self, servicer: Any, credential: str | None, ssl_context: ssl.SSLContext | None = None,
                 on_hello: Any = None) -> None:
        self.servicer = servicer
        self.credential = credential
        self.ssl_context = ssl_context
        self.on_hello = on_hello
        self.connections: set[_Accepted] = set()
        self.budget = ConnectionBudget("the Mux socket (--mux-port)")
        self.finishing: set[asyncio.Future[None]] = set()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0) -> int:
        def accept() -> FrameConnection:
            a = _Accepted(self)
            self.connections.add(a)
            return a.conn

        try:
            self._server = await asyncio.get_running_loop().create_server(accept, host, port, ssl=self.ssl_context)
        except OSError as e:
            raise OSError(e.errno, f"cannot bind the Mux socket port {host}:{port} (--mux-port; 0 picks a free "
                                   f"one, -1 turns it off): {e.strerror or e}") from e
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """Stop listening and drop every connection (their requests are cancelled, as at a stream's end)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for a in list(self.connections):
            a.conn.close()
        if self.finishing:
            await asyncio.wait(list(self.finishing), timeout=6.0)
