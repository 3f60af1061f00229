"""``pdcluster router``: flags -> ``RouterConfig`` -> ``RouterServer`` until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from common import event_loop
from common.errors import ConfigError
from common.flags import add_flags, arg_group, config_values
from common.gc_freeze import SERVING_YOUNG_THRESHOLD, freeze_startup_heap
from router.config import ClientSecurity, RouterConfig, WorkerSpec

if TYPE_CHECKING:
    from router.server import RouterServer

logger = logging.getLogger(__name__)


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, RouterConfig)
    add_flags(p, ClientSecurity)
    # Flags that build a field from several values, or act on the process rather than the config.
    w = arg_group(p, "workers")
    w.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT[:BOOTSTRAP_PORT]",
                   help="prefill worker's gRPC address (repeatable); bootstrap port default: from GetServerInfo")
    w.add_argument("--decode", action="append", default=[], metavar="HOST:PORT", help="decode worker (repeatable)")
    w.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                   help="colocated (mode null) worker (repeatable)")
    p.add_argument("--http-port", type=int, default=RouterConfig.http_port,
                   help="OpenAI-compatible HTTP port (0: any free port; -1: off)")
    p.add_argument("--replicas", type=int, default=1,
                   help="router processes sharing the ports via SO_REUSEPORT (needs fixed, non-zero ports)")
    p.add_argument("--admin-token", default=None,
                   help="bearer token of the admin RPCs and /metrics, /v1/workers, timing lookups "
                        "(default: PDCLUSTER_ADMIN_TOKEN, else the cluster secret)")


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    workers = tuple(
        [WorkerSpec.parse(a, "prefill") for a in ns.prefill]
        + [WorkerSpec.parse(a, "decode") for a in ns.decode]
        + [WorkerSpec.parse(a, "colocated") for a in ns.worker]
    )
    security = ClientSecurity(**config_values(ClientSecurity, ns))
    return RouterConfig(
        **config_values(RouterConfig, ns),
        http_port=None if ns.http_port < 0 else ns.http_port,
        workers=workers,
        **({"admin_token": ns.admin_token} if ns.admin_token is not None else {}),
        api_keys=security.api_keys(),
        tls=security.tls,
    )


def run_router(ns: argparse.Namespace) -> int:
    cfg = config_from_args(ns)
    if ns.replicas > 1:
        import sys

        from router.replicas import run_replicas

        if cfg.grpc_port == 0 or cfg.http_port == 0:
            raise ConfigError("--replicas needs fixed ports: replicas share them, so 0 (pick any) cannot work")
        argv = sys.argv[sys.argv.index("router"):]
        return run_replicas(ns.replicas, argv)
    event_loop.run(_serve(cfg), cfg.event_loop)
    return 0


async def _serve(cfg: RouterConfig) -> None:
    from router.server import RouterServer

    server = RouterServer(cfg)
    await server.start()
    freeze_startup_heap(SERVING_YOUNG_THRESHOLD)
    print(
        f"router ready grpc={server.grpc_address} http={server.http_url if cfg.http_port is not None else '-'}",
        flush=True,
    )
    await serve_until_signal(server)


async def serve_until_signal(server: RouterServer) -> None:
    """Serve until SIGINT/SIGTERM, then drain (``--drain-timeout``; a second signal cuts it short) and stop.
    The handlers are this loop's while it serves; the defaults come back after."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        for sig in signals:
            loop.add_signal_handler(sig, server.service.drain.expire_now)
        await server.drain(server.cfg.drain_timeout_s)
        logger.info("router stopping")
        await server.stop()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
