"""Liveness that sees a hung engine: scheduler ranks heartbeat to the front, and ``GET /liveness`` on the metrics
port fails once a rank has not stepped for ``--watchdog-timeout`` seconds, while the front itself keeps serving.
A real node process with the tiny model; the hang is a SIGSTOP of its rank process (started by this test)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.errors import ConfigError
from common.node.http_probe import node_liveness
from tests.model_fixtures import make_tiny_model
from tests.node_helpers import Node, free_port, rank_pids, start_node

WATCHDOG_S = 2.0


def _liveness(port: int) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/liveness", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_status(port: int, want: int, timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    status, body = _liveness(port)
    while status != want and time.monotonic() < deadline:
        time.sleep(0.2)
        status, body = _liveness(port)
    assert status == want, f"/liveness stayed {status} {body} for {timeout} s"
    return body


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Node, int]]:
    metrics_port = free_port()
    n = start_node("null", make_tiny_model("llama"),
                   extra=["--metrics-port", str(metrics_port), "--watchdog-timeout", str(WATCHDOG_S)])
    try:
        yield n, metrics_port
    finally:
        n.stop()


@pytest.mark.slow
def test_idle_node_stays_live_past_the_watchdog_timeout(node: tuple[Node, int]) -> None:
    _, port = node
    deadline = time.monotonic() + 2 * WATCHDOG_S
    while time.monotonic() < deadline:
        status, body = _liveness(port)
        assert status == 200 and body == {"live": True, "error": None}
        time.sleep(0.5)


@pytest.mark.slow
def test_hung_rank_fails_liveness_while_the_front_serves(node: tuple[Node, int]) -> None:
    n, port = node
    (rank_pid,) = rank_pids(n.proc.pid)
    os.kill(rank_pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        body = _wait_status(port, 503, WATCHDOG_S + 3.0)
        assert time.monotonic() - stopped >= WATCHDOG_S - 0.6  # not before the timeout (one heartbeat of slack)
        assert "scheduler rank dp=0 tp=0 has not stepped" in str(body["error"])
        health = health_pb2_grpc.HealthStub(n.channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.status == 200 and b"pdcluster_node_requests_total" in r.read()
    finally:
        os.kill(rank_pid, signal.SIGCONT)
    _wait_status(port, 200, 5.0)
    assert n.proc.poll() is None


class _FakeRanks:
    def __init__(self, alive: bool, stalled: dict[str, float]) -> None:
        self._alive, self._stalled = alive, stalled

    def alive(self) -> bool:
        return self._alive

    def stalled_ranks(self, timeout: float) -> dict[str, float]:
        return self._stalled


def test_liveness_check_reports_dead_and_stalled_ranks() -> None:
    assert node_liveness(_FakeRanks(True, {}), 300)() is None
    assert "not running" in str(node_liveness(_FakeRanks(False, {}), 300)())
    assert "rank dp=1 tp=0 has not stepped for 301.0 s" in str(
        node_liveness(_FakeRanks(True, {"dp=1 tp=0": 301.0}), 300)())


def test_watchdog_timeout_must_be_positive() -> None:
    from common.config import ServerArgs

    with pytest.raises(ConfigError, match="--watchdog-timeout"):
        ServerArgs(watchdog_timeout=0)
    assert ServerArgs().watchdog_timeout == 300.0


def test_tp_collectives_outwait_a_short_watchdog() -> None:
    """Ranks loading their shards may start a collective seconds apart: a test's 3 s watchdog must not time them out;
    the production watchdog (300 s) stays the bound."""
    from common.config import TP_MIN_TIMEOUT_S, ServerArgs

    assert ServerArgs(watchdog_timeout=3.0).tp_timeout_s == TP_MIN_TIMEOUT_S
    assert ServerArgs().tp_timeout_s == 300.0
