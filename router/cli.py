"""``pdcluster router``: flags -> ``RouterConfig`` -> ``RouterServer`` until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from common import env, event_loop
from common.errors import ConfigError
from common.gc_freeze import freeze_startup_heap
from common.tls import TlsFiles
from router.config import MUX_TRANSPORTS, POLICIES, RouterConfig, WorkerSpec

if TYPE_CHECKING:
    from router.server import RouterServer

logger = logging.getLogger(__name__)


def add_router_args(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    p.add_argument(
        "--model-path",
        default=None,
        help="local HF model folder (tokenizer, chat template, config.json); default: the embedded model",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: the folder's name)"
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--grpc-port", type=int, default=d.grpc_port, help="pdcluster.v1.Router gRPC port")
    p.add_argument("--http-port", type=int, default=d.http_port, help="OpenAI-compatible HTTP port (-1: off)")
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="HOST:PORT[:BOOTSTRAP_PORT]",
        help="prefill worker's gRPC address (repeatable); bootstrap port default: from GetServerInfo",
    )
    p.add_argument(
        "--decode", action="append", default=[], metavar="HOST:PORT", help="decode worker (repeatable)"
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="colocated (mode null) worker (repeatable)",
    )
    p.add_argument("--prefill-policy", choices=POLICIES, default=d.prefill_policy)
    p.add_argument("--decode-policy", choices=POLICIES, default=d.decode_policy)
    p.add_argument(
        "--max-retries",
        type=int,
        default=d.max_retries,
        help="extra attempts after attempts that failed before producing a token",
    )
    p.add_argument(
        "--max-migrations",
        type=int,
        default=d.max_migrations,
        help="times a request whose decode/colocated leg failed after producing tokens continues on another "
        "worker from those tokens (0: fail it)",
    )
    p.add_argument(
        "--retry-backoff", type=float, default=d.retry_backoff_s, help="first retry backoff, seconds"
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout_s,
        help="deadline of a request without a client deadline, seconds",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout_s,
        help="SIGTERM: seconds requests in flight may go on (new ones get 503 / UNAVAILABLE) before the rest are "
        "aborted; a second SIGTERM cuts it short",
    )
    p.add_argument("--cb-failure-threshold", type=int, default=d.cb_failure_threshold)
    p.add_argument("--cb-open-seconds", type=float, default=d.cb_open_s)
    p.add_argument("--health-interval", type=float, default=d.health_interval_s)
    p.add_argument("--load-interval", type=float, default=d.load_interval_s)
    p.add_argument("--admission-wait", type=float, default=d.admission_wait_s,
                   help="seconds a request waits for a decode worker to report room for it (never sent to one whose "
                        "last report says it cannot admit); then 429")
    p.add_argument("--cache-threshold", type=float, default=d.cache_threshold)
    p.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold)
    p.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold)
    p.add_argument("--prefix-tree-blocks", type=int, default=d.prefix_tree_blocks,
                   help="cache_aware: most prefix blocks remembered per worker rank (each also bounded by its KV pool)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes)
    p.add_argument(
        "--tokenize-workers",
        type=int,
        default=d.tokenize_workers,
        help="processes that tokenize prompts over --tokenize-inline-bytes off the event loop (0: all inline)",
    )
    p.add_argument("--tokenize-inline-bytes", type=int, default=d.tokenize_inline_bytes)
    p.add_argument(
        "--max-inflight-requests",
        type=int,
        default=d.max_inflight_requests,
        help="requests served at once (0: unbounded); beyond it HTTP 429 / RESOURCE_EXHAUSTED with Retry-After",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router processes sharing the ports via SO_REUSEPORT (needs fixed, non-zero ports)",
    )
    p.add_argument("--reuse-port", action="store_true", help="bind with SO_REUSEPORT (set by --replicas)")
    p.add_argument("--event-loop", choices=event_loop.EVENT_LOOPS, default=d.event_loop,
                   help="auto: uvloop when installed, else asyncio's loop")
    p.add_argument("--mux-transport", choices=MUX_TRANSPORTS, default=d.mux_transport,
                   help="request legs to a node: socket (its Mux socket when it offers one, else its gRPC Mux "
                        "stream) or grpc (always the gRPC stream, e.g. through a proxy that passes only HTTP/2)")
    p.add_argument("--admin-token", default=None,
                   help="bearer token of the admin RPCs and /metrics, /v1/workers, timing lookups "
                        "(default: PDCLUSTER_ADMIN_TOKEN, else the cluster secret)")
    s = p.add_argument_group("client security")
    s.add_argument("--api-key", default=None,
                   help="bearer key of generation and model calls (visible in ps: prefer --api-key-file or "
                        "PDCLUSTER_API_KEY[_FILE]); default: open")
    s.add_argument("--api-key-file", default=None, help="file whose first line is the API key")
    s.add_argument("--tls-cert", default=None, help="PEM certificate chain: HTTP and gRPC listeners serve TLS")
    s.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    s.add_argument("--tls-ca", default=None,
                   help="PEM CA bundle: mutual TLS to the nodes (their certificates must chain to it; the router "
                        "presents --tls-cert)")
    s.add_argument("--tls-server-name", default=None,
                   help="name the nodes' certificates carry (default: the host of each node's address)")


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    workers = tuple(
        [WorkerSpec.parse(a, "prefill") for a in ns.prefill]
        + [WorkerSpec.parse(a, "decode") for a in ns.decode]
        + [WorkerSpec.parse(a, "colocated") for a in ns.worker]
    )
    return RouterConfig(
        model_path=ns.model_path,
        served_model_name=ns.served_model_name,
        host=ns.host,
        grpc_port=ns.grpc_port,
        http_port=None if ns.http_port < 0 else ns.http_port,
        workers=workers,
        prefill_policy=ns.prefill_policy,
        decode_policy=ns.decode_policy,
        max_retries=ns.max_retries,
        max_migrations=ns.max_migrations,
        retry_backoff_s=ns.retry_backoff,
        request_timeout_s=ns.request_timeout,
        admission_wait_s=ns.admission_wait,
        drain_timeout_s=ns.drain_timeout,
        cb_failure_threshold=ns.cb_failure_threshold,
        cb_open_s=ns.cb_open_seconds,
        health_interval_s=ns.health_interval,
        load_interval_s=ns.load_interval,
        cache_threshold=ns.cache_threshold,
        balance_abs_threshold=ns.balance_abs_threshold,
        balance_rel_threshold=ns.balance_rel_threshold,
        prefix_tree_blocks=ns.prefix_tree_blocks,
        max_request_bytes=ns.max_request_bytes,
        tokenize_workers=ns.tokenize_workers,
        tokenize_inline_bytes=ns.tokenize_inline_bytes,
        max_inflight_requests=ns.max_inflight_requests,
        reuse_port=ns.reuse_port,
        event_loop=ns.event_loop,
        mux_transport=ns.mux_transport,
        **({"admin_token": ns.admin_token} if ns.admin_token is not None else {}),
        api_key=api_key_from_args(ns),
        tls=TlsFiles(ns.tls_cert, ns.tls_key, ns.tls_ca),
        tls_server_name=ns.tls_server_name,
    )


def api_key_from_args(ns: argparse.Namespace) -> str:
    """--api-key, else --api-key-file, else PDCLUSTER_API_KEY / PDCLUSTER_API_KEY_FILE, else "" (open)."""
    if ns.api_key is not None and ns.api_key_file is not None:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if ns.api_key is not None:
        return ns.api_key
    if ns.api_key_file is not None:
        return env.read_secret_file(ns.api_key_file, "--api-key-file")
    return env.api_key()


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
    freeze_startup_heap()
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
