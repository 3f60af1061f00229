"""A node's HTTP side port (``--metrics-port``): ``GET /metrics`` (Prometheus) and ``GET /liveness``.

``/liveness`` answers 200 while every scheduler rank process lives and has heartbeated within
``--watchdog-timeout`` seconds, 503 otherwise (a rank stuck inside a step, or dead). It stays 200 while the node
drains: readiness (gRPC health) is what turns off then. The server runs in daemon threads; the check only reads
the ``RankClient``'s heartbeat times, so a busy event loop cannot make it hang.

The port has no credential: every connection holds a slot of a ``ConnectionBudget`` (per peer host and in all; at a
bound the oldest connection is closed to make room) until it ends, and each socket read or write has
``HELLO_DEADLINE_S`` (a silent or trickling client loses its thread instead of holding it).
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from common.node.conn_budget import HELLO_DEADLINE_S, ConnectionBudget, Slot, peer_host

LivenessCheck = Callable[[], str | None]  # None: live; otherwise why not


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # the listen backlog (socketserver: 5): a burst of connects is not held in SYN retries
    budget = ConnectionBudget("the metrics port (--metrics-port)")  # replaced per server in start_probe_server
    slots: dict[Any, Slot]  # request socket -> its slot, from the accept to the end of its thread

    def verify_request(self, request: Any, client_address: Any) -> bool:
        self.slots[request] = self.budget.admit(peer_host(client_address), lambda: _drop(request))
        return True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went silent (timed out) or away: nothing to report per connection

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.budget.release(self.slots.pop(request))


def _drop(request: socket.socket) -> None:
    """End a reclaimed connection: its thread's blocked read returns at once and the thread ends."""
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


class _QuietHandler(WSGIRequestHandler):
    timeout = HELLO_DEADLINE_S

    def log_message(self, format: str, *args: Any) -> None:
        pass


def node_liveness(ranks: Any, watchdog_timeout: float) -> LivenessCheck:
    """The liveness check of a node over its ``RankClient``."""

    def check() -> str | None:
        if not ranks.alive():
            return "a scheduler rank process is not running"
        stalled = ranks.stalled_ranks(watchdog_timeout)
        if stalled:
            return "; ".join(f"scheduler rank {r} has not stepped for {age:.1f} s (--watchdog-timeout "
                             f"{watchdog_timeout:g})" for r, age in sorted(stalled.items()))
        return None

    return check


def probe_app(liveness: LivenessCheck) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/liveness":
            return metrics(environ, start_response)
        error = liveness()
        body = json.dumps({"live": error is None, "error": error}).encode()
        status = "200 OK" if error is None else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return app


def start_probe_server(port: int, host: str, liveness: LivenessCheck) -> WSGIServer:
    """Serve ``/metrics`` and ``/liveness`` on ``host:port`` from a daemon thread; ``shutdown()`` stops it."""
    server = make_server(host, port, probe_app(liveness), _ThreadingWSGIServer, handler_class=_QuietHandler)
    server.budget = ConnectionBudget("the metrics port (--metrics-port)")
    server.slots = {}
    threading.Thread(target=server.serve_forever, name="pdcluster-probe-http", daemon=True).start()
    return server
