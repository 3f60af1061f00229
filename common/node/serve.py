"""``pdcluster serve``: run one node (front process + DP scheduler ranks) until SIGINT/SIGTERM.

On SIGTERM the node drains: health turns NOT_SERVING, new requests get UNAVAILABLE, in-flight requests get
``--drain-timeout`` seconds to finish, then the ranks stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.config import ServerArgs
from common.engine.model.config import ModelConfig
from common.gc_freeze import SERVING_YOUNG_THRESHOLD, freeze_startup_heap
from common.node.front import WorkerServicer
from common.node.http_probe import node_liveness, start_probe_server
from common.node.metrics import poll_load_forever
from common.node.mux_socket_server import MuxSocketServer
from common.node.ranks import RankClient
from common.node.roles import ROLES
from common.refs import load_ref
from common.text.tokenizer import resolve_model_path
from common.wire.security import require_cluster_token
from common.wire.worker_auth import WorkerAuthInterceptor, worker_credential
from pdcluster.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


NODE_SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),
    # The router pings every 10 s while it holds a Mux stream (router/workers.py CHANNEL_OPTIONS): accept that
    # (gRPC's default minimum is 5 min; more frequent pings would get the connection closed as abusive).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
)


class NodeServer:
    """A running node. ``start`` returns when every rank is ready and the gRPC port serves."""

    def __init__(self, args: ServerArgs) -> None:
        args.tls.check()
        require_cluster_token(args.disaggregation_mode)
        self.args = args
        self.role = ROLES[args.disaggregation_mode]
        self.model_path = str(resolve_model_path(args.model_path))
        self.args = args.replace(model_path=self.model_path)
        self.ranks = RankClient(self.args, self.model_path)
        self.ranks.spawn()
        try:
            self.model_config = ModelConfig.from_path(self.model_path, self.args.load_format)
        except BaseException:
            self.ranks.kill()
            raise
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.servicer: WorkerServicer | None = None
        self._cleanups: list[Callable[[], Any]] = []
        self.port = args.port
        self._metrics_task: asyncio.Task[None] | None = None
        self._probe_server: Any = None
        self._sglang_http: Any = None  # SglangHttpServer with --sglang-http-port
        self.mux_socket: MuxSocketServer | None = None
        self.rank_died = False  # a rank exited on its own: the node stops with a non-zero exit code

    async def start(self) -> None:
        self.server = grpc.aio.server(options=NODE_SERVER_OPTIONS, interceptors=[WorkerAuthInterceptor()])
        servicer_cls = load_ref(self.role.servicer_ref)
        self.servicer = servicer_cls(self.args, self.model_path, self.model_config, self.ranks)
        if self.role.extra_services:
            cleanup = await load_ref(self.role.extra_services)(self.args, self.servicer)
            if cleanup is not None:
                self._cleanups.append(cleanup)
        await self.ranks.start()
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name, reflection.SERVICE_NAME,
                 health.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        address, tls = f"{self.args.host}:{self.args.port}", self.args.tls
        self.port = (self.server.add_secure_port(address, tls.grpc_server_credentials()) if tls.enabled
                     else self.server.add_insecure_port(address))
        if self.port == 0:
            raise OSError(f"cannot bind the Worker gRPC port {self.args.host}:{self.args.port}")
        self.servicer.grpc_port = self.port
        await self.server.start()
        if self.args.mux_port >= 0:
            self.mux_socket = MuxSocketServer(self.servicer, worker_credential(),
                                              tls.server_ssl_context() if tls.enabled else None)
            self.servicer.mux_socket_port = await self.mux_socket.start(self.args.host, self.args.mux_port)
        if self.args.metrics_port is not None:
            self._probe_server = start_probe_server(
                self.args.metrics_port, self.args.host, node_liveness(self.ranks, self.args.watchdog_timeout)
            )
            self._metrics_task = asyncio.create_task(poll_load_forever(self.ranks))
        if self.args.sglang_http_port is not None:
            from common.node.sglang_http import SglangHttpServer

            self._sglang_http = SglangHttpServer(self.args, self.servicer)
            await self._sglang_http.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("pdcluster.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "node ready: mode=%s grpc=%s:%d mux-socket=%s dp=%d tp=%d model=%s", self.args.disaggregation_mode,
            self.args.host, self.port, self.mux_socket.port if self.mux_socket is not None else "off",
            self.args.dp_size, self.args.tp_size, self.model_path,
        )

    async def drain_and_stop(self) -> None:
        assert self.servicer is not None and self.server is not None
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = asyncio.get_running_loop().time() + self.args.drain_timeout
        while self.ranks.waiters and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        await self.server.stop(grace=1.0)
        if self.mux_socket is not None:
            await self.mux_socket.stop()
        if self._sglang_http is not None:
            await self._sglang_http.stop()
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        for cleanup in self._cleanups:
            await cleanup()
        await self.ranks.close()
        if self._probe_server is not None:
            self._probe_server.shutdown()
            self._probe_server.server_close()

    async def wait_for_signal(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        ranks_dead = asyncio.create_task(self._watch_ranks(stop))
        await stop.wait()
        ranks_dead.cancel()

    async def _watch_ranks(self, stop: asyncio.Event) -> None:
        while self.ranks.alive():
            await asyncio.sleep(0.5)
        logger.error("a scheduler rank died; the node shuts down")
        self.rank_died = True
        stop.set()


async def serve_tp_host(args: ServerArgs) -> int:
    """``--node-rank`` > 0: run this host's share of the TP ranks; node 0 serves the Worker and Bootstrap services.

    Exits non-zero when a local rank dies (its group's collectives then fail on every host, node 0 included), and
    zero when its ranks stop on node 0's shutdown.
    """
    require_cluster_token(args.disaggregation_mode)
    model_path = str(resolve_model_path(args.model_path))
    ranks = RankClient(args.replace(model_path=model_path), model_path)
    try:
        await ranks.start()
    except BaseException:
        await ranks.close()
        raise
    print(f"pdcluster TP host ready: node rank {args.node_rank}/{args.nnodes}, tp ranks "
          f"{list(args.tp_ranks_here)} of {args.tp_size}, rendezvous {args.dist_init_addr}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set() and ranks.alive():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    # Ranks that all exited 0 followed node 0's shutdown (broadcast through the group); anything else is a death.
    died = not stop.is_set() and any(p.exitcode != 0 for p in ranks.procs)
    await ranks.close()
    if died:
        logger.error("a scheduler rank of this host died; it stops (exit code 1)")
    return 1 if died else 0


async def serve(args: ServerArgs) -> int:
    if args.node_rank > 0:
        return await serve_tp_host(args)
    node = NodeServer(args)
    try:
        await node.start()
    except BaseException:
        await node.ranks.close()
        raise
    freeze_startup_heap(SERVING_YOUNG_THRESHOLD)  # a node process's own start-up; in-process NodeServers (tests) leave their host's GC alone
    print(f"pdcluster node ready: mode={args.disaggregation_mode} grpc={args.host}:{node.port}", flush=True)
    await node.wait_for_signal()
    await node.drain_and_stop()
    if node.rank_died:
        logger.error("node stopped because a scheduler rank died (exit code 1)")
        return 1
    return 0
