"""``ManagedProcess``: one ``pdcluster`` subcommand run as a child process that dies with its parent (Linux
``PR_SET_PDEATHSIG``), with grpc.health.v1 readiness and a SIGTERM-then-SIGKILL stop. Used by the Ray actors."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # NOTE: runs in the child between fork and exec. The signal fires when the forking *thread* exits, so
    # callers must spawn from a thread that lives as long as the owner (the actor's main thread).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def grpc_serving(address: str, timeout: float = 2.0, service: str = "") -> bool:
    """True when ``address`` answers grpc.health.v1 Check(service) with SERVING."""
    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


class ManagedProcess:
    """``python -m common.app.cli <argv>``; its output goes to ``log_path``."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv = [sys.executable, "-m", "common.app.cli", *argv]
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_serving(self, address: str, timeout: float) -> None:
        """Block until ``address`` is SERVING; raise with the log tail if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.argv[3]} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if grpc_serving(address, timeout=1.0):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.argv[3]} on {address} not SERVING after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace: float) -> int | None:
        """SIGTERM (the node drains), then SIGKILL after ``grace`` seconds. Returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
