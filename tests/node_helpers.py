"""Start and stop real node processes (``pdcluster serve``) on 127.0.0.1 for tests; talk to them over gRPC."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.ports import pick_free_port
from common.wire.worker_auth import worker_channel
from pdcluster.v1 import worker_pb2, worker_pb2_grpc

START_TIMEOUT_S = 120.0


def rank_pids(front_pid: int) -> list[int]:
    """A node's scheduler rank processes: the multiprocessing-spawned children of its front process."""
    children = Path(f"/proc/{front_pid}/task/{front_pid}/children").read_text().split()
    pids = []
    for pid in map(int, children):
        with contextlib.suppress(FileNotFoundError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    return pids


def free_port() -> int:
    return pick_free_port()


@dataclass
class Node:
    mode: str
    port: int
    bootstrap_port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    channel: grpc.Channel = field(init=False)
    stub: worker_pb2_grpc.WorkerStub = field(init=False)

    def __post_init__(self) -> None:
        self.channel = worker_channel(f"127.0.0.1:{self.port}")  # carries the cluster credential
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def bootstrap_addr(self) -> str:
        return f"127.0.0.1:{self.bootstrap_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.mode} node exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(grpc.RpcError):
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{self.mode} node not ready in {timeout} s:\n{self.log()}")

    def load(self) -> worker_pb2.GetLoadResponse:
        return self.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)

    def wait_pools_free(self, timeout: float = 30.0) -> worker_pb2.GetLoadResponse:
        """Wait until every rank is idle with all KV pages (free + evictable) and request slots back."""
        deadline = time.monotonic() + timeout
        while True:
            load = self.load()
            if all(
                r.free_kv_pages * load.page_size + r.evictable_tokens >= r.total_kv_pages * load.page_size
                and r.free_req_slots == r.total_req_slots and r.running == 0 and r.waiting == 0
                and r.bootstrap == 0 and r.inflight == 0 and r.prealloc == 0 and r.transfer == 0
                for r in load.ranks
            ):
                return load
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.mode} node pools not back at their free counts: {load}")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_node(
    mode: str, model_path: Path | str, *, backend: str = "tcp", dp_size: int = 1, extra: list[str] | None = None,
    wait: bool = True,
) -> Node:
    port, bootstrap_port = free_port(), free_port()
    log = Path(tempfile.mkstemp(prefix=f"pdcluster-{mode}-", suffix=".log")[1])
    cmd = [
        sys.executable, "-m", "common.app.cli", "serve", "--model-path", str(model_path), "--host", "127.0.0.1",
        "--port", str(port), "--disaggregation-mode", mode, "--disaggregation-bootstrap-port", str(bootstrap_port),
        "--kv-transfer-backend", backend, "--dp-size", str(dp_size), "--max-total-tokens", "4096",
        "--max-running-requests", "32", "--torch-num-threads", "1", "--drain-timeout", "2", *(extra or []),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    node = Node(mode, port, bootstrap_port, proc, log)
    if wait:
        try:
            node.wait_ready()
        except BaseException:
            node.kill()
            raise
    return node


def wait_all(nodes: list[Node]) -> list[Node]:
    """Wait until every node (started with ``wait=False``, so they start side by side) is ready; on failure kill
    them all."""
    try:
        for n in nodes:
            n.wait_ready()
    except BaseException:
        for n in nodes:
            n.kill()
        raise
    return nodes
