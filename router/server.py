"""``RouterServer``: the router process's servers - gRPC (Router + health + reflection) and the HTTP gateway - on
one event loop over one ``RouterService``. Used by ``pdcluster router``, ``pdcluster up`` and the tests."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdcluster.v1 import router_pb2, router_pb2_grpc
from router.admin import AdminInterceptor
from router.client_auth import ApiKeyInterceptor
from router.config import RouterConfig
from router.grpc_guard import ParseGuard
from router.grpc_service import RouterServicer
from router.http_gateway import HttpGateway
from router.service import RouterService

logger = logging.getLogger(__name__)
ROUTER_SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


class RouterServer:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.service = RouterService(cfg)  # loads the tokenizer: blocking, once
        self.grpc_port = 0
        self.http_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._health: health.aio.HealthServicer | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        await self.service.start()
        cfg = self.cfg
        # NOTE: the credential checks come before ParseGuard: an unauthenticated request is never parsed.
        guards: list[grpc.aio.ServerInterceptor] = [AdminInterceptor(cfg.admin_token), ParseGuard()]
        if cfg.api_keys:
            guards.insert(0, ApiKeyInterceptor(self.service.client_secrets))
        server = grpc.aio.server(
            interceptors=guards,
            options=[
                ("grpc.max_receive_message_length", cfg.max_request_bytes),
                ("grpc.so_reuseport", 1 if cfg.reuse_port else 0),
            ]
        )
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(self.service), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (
                ROUTER_SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        address = f"{cfg.host}:{cfg.grpc_port}"
        self.grpc_port = (server.add_secure_port(address, cfg.listener_tls.grpc_server_credentials()) if cfg.tls.enabled
                          else server.add_insecure_port(address))
        if self.grpc_port == 0:
            raise OSError(f"cannot bind the router's gRPC port {cfg.host}:{cfg.grpc_port}")
        await server.start()
        for name in ("", ROUTER_SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._grpc, self._health = server, health_servicer
        if cfg.http_port is not None:
            gateway = HttpGateway(self.service)
            runner = web.AppRunner(gateway.app, handler_cancellation=True, access_log=None)
            await runner.setup()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if cfg.reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((cfg.host, cfg.http_port))
            self.http_port = sock.getsockname()[1]
            ssl_context = cfg.listener_tls.server_ssl_context() if cfg.tls.enabled else None
            await web.SockSite(runner, sock, ssl_context=ssl_context).start()
            self._http = runner
        logger.info(
            "router serving: gRPC %s:%d, HTTP %s, TLS %s, API key %s, model %r, policies prefill=%s decode=%s",
            cfg.host,
            self.grpc_port,
            f"{cfg.host}:{self.http_port}" if self._http else "off",
            ("on, mutual to nodes" if cfg.tls.mutual else "on") if cfg.tls.enabled else "off",
            "required" if cfg.api_keys else "off",
            self.service.model_name,
            cfg.prefill_policy,
            cfg.decode_policy,
        )

    async def drain(self, timeout_s: float) -> None:
        """Graceful stop, before ``stop``: new generation calls are refused and readiness (HTTP ``/health``, gRPC
        health) goes false; calls in flight get up to ``timeout_s`` to finish, then both legs of the rest are
        aborted (router/drain.py). Listeners stay open meanwhile, so refusals are answered, not reset."""
        if self._health is not None:
            for name in ("", ROUTER_SERVICE_NAME):
                await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        drain = self.service.drain
        logger.info("router draining: %d request(s) in flight get up to %.1f s", drain.in_flight, timeout_s)
        cut = await drain.run(timeout_s, self.cfg.rpc_timeout_s)
        if cut:
            logger.warning("router drain timed out: cancelled %d request(s): %s", len(cut), ", ".join(cut[:20]))

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._stopped.is_set():
            return
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
            self._grpc = None
        await self.service.stop()
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()

    @property
    def grpc_address(self) -> str:
        return f"{self.cfg.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        scheme = "https" if self.cfg.tls.enabled else "http"
        return f"{scheme}://{self.cfg.host}:{self.http_port}"
