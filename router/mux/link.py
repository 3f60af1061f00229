"""``MuxLink``: the Mux stream to one worker, opened on first use and again after it ends; over the node's Mux
socket when it offers one and the router may use it, else over the gRPC call; per-request RPCs when the worker does
not serve ``Worker.Mux`` at all."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable

import grpc

from common.wire.mux_frames import MUX_METADATA_KEY
from common.wire.mux_socket import SOCKET_METADATA_KEY, FrameConnection, connect
from common.wire.worker_auth import credential_metadata, worker_credential
from pdcluster.v1 import worker_pb2, worker_pb2_grpc
from router.mux.io import GrpcMuxIO, SocketMuxIO, rpc_error
from router.mux.stream import MuxStream

logger = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 5.0  # for a node's answer (its initial metadata) to a new Mux stream


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
