"""The Bootstrap gRPC service (``pdcluster.v1.Bootstrap``): a registry of one prefill node's ranks.

``BootstrapServer`` runs inside the prefill front's ``grpc.aio`` server (``add_to_server``) or standalone
(``start``/``stop``, its own thread and event loop). ``BootstrapClient`` is the blocking client the managers use
from their background threads (never from the scheduler thread).

Invariant: the table holds at most one entry per (dp_rank, tp_rank); a re-registration replaces it, so
"ready" (all dp_size * tp_size ranks present) can not be reached with a restarted rank counted twice.
Only a rank that proves the cluster secret registers (``registration_proof``: an HMAC over the request and a fresh
timestamp; the secret is never sent); lookups are open, as decode ranks resolve addresses a client named.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import threading
import time
from dataclasses import dataclass

import grpc

from common import env
from common.wire.worker_auth import ChallengeRefused, answer_challenge
from pdcluster.v1 import bootstrap_pb2 as pb
from pdcluster.v1 import bootstrap_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# The port is open before any proof (lookups need none): its messages are a few hundred bytes, a connection must
# finish its HTTP/2 handshake within 5 s and is closed after a minute idle, and concurrent calls are capped.
SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", 16 << 10),
    ("grpc.server_handshake_timeout_ms", 5_000),
    ("grpc.max_connection_idle_ms", 60_000),
    ("grpc.max_concurrent_streams", 16),
)
MAX_CONCURRENT_RPCS = 256
PROOF_MAX_AGE_S = 60.0  # a registration signed longer ago (or further ahead, clock skew) is refused


def registration_proof(secret: str, request: pb.RegisterRankRequest) -> bytes:
    fields = (request.dp_rank, request.tp_rank, request.dp_size, request.tp_size, request.control_addr,
              request.instance_id, request.epoch, request.issued_at_ms)
    data = b"register\0" + b"\0".join(str(f).encode() for f in fields)
    return hmac.new(secret.encode(), data, hashlib.sha256).digest()


@dataclass(frozen=True)
class RankEntry:
    control_addr: str
    instance_id: str
    epoch: int


class BootstrapError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class RankTable:
    """The registered prefill ranks of one node. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: tuple[int, int] | None = None  # (dp_size, tp_size), fixed by the first registration
        self._ranks: dict[tuple[int, int], RankEntry] = {}

    def register(self, dp_rank: int, tp_rank: int, dp_size: int, tp_size: int, entry: RankEntry) -> tuple[int, int]:
        """Add or replace one rank; returns (registered, expected)."""
        if not (0 <= dp_rank < dp_size and 0 <= tp_rank < tp_size):
            raise BootstrapError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"rank dp={dp_rank} tp={tp_rank} outside dp_size={dp_size} tp_size={tp_size}")
        with self._lock:
            if self._sizes not in (None, (dp_size, tp_size)):
                raise BootstrapError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"sizes dp_size={dp_size} tp_size={tp_size} disagree with registered ranks' "
                                     f"dp_size={self._sizes[0]} tp_size={self._sizes[1]}")
            self._sizes = (dp_size, tp_size)
            old = self._ranks.get((dp_rank, tp_rank))
            if old is not None and old.epoch > entry.epoch:
                raise BootstrapError(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"rank dp={dp_rank} tp={tp_rank} already registered with newer epoch {old.epoch}")
            self._ranks[(dp_rank, tp_rank)] = entry
            return len(self._ranks), dp_size * tp_size

    def topology(self) -> tuple[int, int]:
        with self._lock:
            if self._sizes is None or len(self._ranks) < self._sizes[0] * self._sizes[1]:
                have = len(self._ranks)
                want = "?" if self._sizes is None else self._sizes[0] * self._sizes[1]
                raise BootstrapError(grpc.StatusCode.UNAVAILABLE, f"prefill not ready: {have}/{want} ranks registered")
            return self._sizes

    def rank(self, dp_rank: int, tp_rank: int) -> RankEntry:
        dp_size, tp_size = self.topology()
        with self._lock:
            entry = self._ranks.get((dp_rank, tp_rank))
        if entry is None:
            raise BootstrapError(grpc.StatusCode.NOT_FOUND,
                                 f"no prefill rank dp={dp_rank} tp={tp_rank} (dp_size={dp_size}, tp_size={tp_size})")
        return entry


class _Servicer(pb_grpc.BootstrapServicer):
    """Thin adapter: proto <-> RankTable."""

    def __init__(self, table: RankTable, secret: str) -> None:
        self.table = table
        self._secret = secret
        self.refused = 0  # registrations without a valid proof
        self.own_port = 0  # the port this service is bound to (0: unknown, membership challenges go unanswered)

    async def RegisterRank(self, request: pb.RegisterRankRequest, context: grpc.aio.ServicerContext):
        age_s = abs(time.time() - request.issued_at_ms / 1000)
        if not self._secret or age_s > PROOF_MAX_AGE_S or not hmac.compare_digest(
                registration_proof(self._secret, request), request.proof):
            self.refused += 1
            log.warning("bootstrap: refused a RegisterRank of dp=%d tp=%d without a valid proof of the cluster secret",
                        request.dp_rank, request.tp_rank)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "RegisterRank needs a fresh proof of the cluster secret (PDCLUSTER_CLUSTER_TOKEN)")
        entry = RankEntry(request.control_addr, request.instance_id, request.epoch)
        try:
            registered, expected = self.table.register(request.dp_rank, request.tp_rank, request.dp_size,
                                                       request.tp_size, entry)
        except BootstrapError as exc:
            await context.abort(exc.code, str(exc))
        log.info("bootstrap: registered prefill rank dp=%d tp=%d at %s (%d/%d)", request.dp_rank, request.tp_rank,
                 request.control_addr, registered, expected)
        return pb.RegisterRankResponse(registered=registered, expected=expected)

    async def GetTopology(self, request: pb.GetTopologyRequest, context: grpc.aio.ServicerContext):
        try:
            dp_size, tp_size = self.table.topology()
        except BootstrapError as exc:
            await context.abort(exc.code, str(exc))
        reply = pb.Topology(dp_size=dp_size, tp_size=tp_size)
        if request.nonce:
            try:
                reply.membership_proof = answer_challenge(request.nonce, request.address, self.own_port, self._secret)
            except ChallengeRefused as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return reply

    async def GetRank(self, request: pb.GetRankRequest, context: grpc.aio.ServicerContext):
        try:
            entry = self.table.rank(request.dp_rank, request.tp_rank)
        except BootstrapError as exc:
            await context.abort(exc.code, str(exc))
        return pb.RankInfo(control_addr=entry.control_addr, instance_id=entry.instance_id, epoch=entry.epoch)


class BootstrapServer:
    """The prefill node's rank registry, served over gRPC."""

    def __init__(self, secret: str | None = None) -> None:
        self.table = RankTable()
        self.servicer = _Servicer(self.table, env.cluster_token() if secret is None else secret)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._stop: asyncio.Event | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Serve ``pdcluster.v1.Bootstrap`` from an existing ``grpc.aio`` server (the prefill front's)."""
        pb_grpc.add_BootstrapServicer_to_server(self.servicer, server)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Standalone: serve on host:port in a background thread; returns the bound port."""
        ready = threading.Event()
        bound: list[int] = []

        async def serve() -> None:
            self._server = grpc.aio.server(options=SERVER_OPTIONS, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
            self.add_to_server(self._server)
            bound.append(self._server.add_insecure_port(f"{host}:{port}"))
            self.servicer.own_port = bound[0]
            await self._server.start()
            self._stop = asyncio.Event()
            ready.set()
            await self._stop.wait()
            await self._server.stop(grace=None)

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(serve())

        self._thread = threading.Thread(target=run, name="kv-bootstrap-server", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"bootstrap server did not start on {host}:{port}")
        return bound[0]

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(5)
        self._thread = self._loop = self._server = self._stop = None


class BootstrapClient:
    """Blocking client of one prefill node's Bootstrap service ("host:port"). Call from background threads only."""

    def __init__(self, addr: str, rpc_timeout_s: float = 5.0) -> None:
        self.addr = addr
        self.rpc_timeout_s = rpc_timeout_s
        self._channel = grpc.insecure_channel(addr)
        self._stub = pb_grpc.BootstrapStub(self._channel)

    def register(self, dp_rank: int, tp_rank: int, dp_size: int, tp_size: int, entry: RankEntry,
                 secret: str) -> None:
        request = pb.RegisterRankRequest(
            dp_rank=dp_rank, tp_rank=tp_rank, dp_size=dp_size, tp_size=tp_size, control_addr=entry.control_addr,
            instance_id=entry.instance_id, epoch=entry.epoch, issued_at_ms=int(time.time() * 1000))
        request.proof = registration_proof(secret, request)
        self._call(self._stub.RegisterRank, request)

    def topology(self) -> tuple[int, int]:
        reply = self._call(self._stub.GetTopology, pb.GetTopologyRequest())
        return reply.dp_size, reply.tp_size

    def rank(self, dp_rank: int, tp_rank: int) -> RankEntry:
        reply = self._call(self._stub.GetRank, pb.GetRankRequest(dp_rank=dp_rank, tp_rank=tp_rank))
        return RankEntry(reply.control_addr, reply.instance_id, reply.epoch)

    def _call(self, method, request):
        try:
            return method(request, timeout=self.rpc_timeout_s)
        except grpc.RpcError as exc:
            raise BootstrapError(exc.code(), f"bootstrap {self.addr}: {exc.details() or exc.code().name}") from None

    def close(self) -> None:
        self._channel.close()
