"""``up``'s readiness probes of its own children: every node's gRPC health SERVING, then the router's HTTP
``/health`` 200, before one shared deadline. A child that exits meanwhile raises at once with its log tail, so a
node's start-up error (a tp its model cannot split, a bad flag) is reported instead of waited out."""

from __future__ import annotations

import contextlib
import ssl
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.app.supervisor import Child

READY_TIMEOUT_S = 300.0
POLL_S = 0.2


def grpc_serving(port: int, tls: grpc.ChannelCredentials | None = None) -> bool:
    address = f"127.0.0.1:{port}"
    channel = grpc.secure_channel(address, tls) if tls is not None else grpc.insecure_channel(address)
    with channel, contextlib.suppress(grpc.RpcError):
        return bool(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1)
    return False


def check_alive(child: Child) -> None:
    code = child.exit_code()
    if code is not None:
        raise RuntimeError(f"{child.name} exited with code {code}; its log:\n{child.tail()}")


def wait_nodes_serving(nodes: list[Child], deadline: float, tls: grpc.ChannelCredentials | None) -> None:
    """Until every node's gRPC health is SERVING; the first node to exit meanwhile raises at once with its log,
    whichever node is being waited for."""
    pending = list(nodes)
    while pending and time.monotonic() < deadline:
        for node in nodes:
            check_alive(node)
        pending = [n for n in pending if not grpc_serving(n.grpc_port, tls)]
        if pending:
            time.sleep(POLL_S)
    if pending:
        names = ", ".join(n.name for n in pending)
        raise TimeoutError(f"{names} not ready within {READY_TIMEOUT_S:.0f} s; the log of {pending[0].name}:\n"
                           f"{pending[0].tail()}")


def wait_http_health(child: Child, base_url: str, deadline: float, tls_enabled: bool) -> None:
    """Until ``base_url/health`` answers 200."""
    # NOTE: a readiness probe of our own child on loopback: it sends nothing secret, so it skips verification.
    probe = None
    if tls_enabled:
        probe = ssl.create_default_context()
        probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
    while time.monotonic() < deadline:
        check_alive(child)
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{base_url}/health", timeout=1,
                                                                  context=probe) as resp:
            if resp.status == 200:
                return
        time.sleep(POLL_S)
    raise TimeoutError(f"router not ready within {READY_TIMEOUT_S:.0f} s; its log:\n{child.tail()}")
