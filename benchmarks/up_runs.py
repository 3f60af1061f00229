"""Shared by the benchmarks that start ``pdcluster up`` and load it through the router with the ``pdcluster bench``
library (``pd_tp``, ``serving_vs_commit``): the cluster process, one driven run, and the per-run key figures.

``args`` of ``drive``/``client_for`` carries ``api``, ``request_timeout``, ``concurrency``, ``rate``, ``time_limit``
and ``grace`` (the scripts' own command lines).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench import machine
from benchmarks.loadgen.clients import Client, GrpcClient, OpenAIClient
from benchmarks.loadgen.runner import LoadShape, run_load
from benchmarks.loadgen.stats import RequestResult
from benchmarks.loadgen.workload import WorkloadConfig, make_workload
from common.ports import pick_free_port

READY_LINE = "pdcluster ready"
CHILD_LINE = re.compile(r"^\s+(\S+)\s+pid (\d+)\s")
STOP_TIMEOUT_S = 60.0  # up's own stop: SIGTERM to its children, 20 s, then SIGKILL
TIMING_KEYS = ("queue", "bootstrap", "prefill", "transfer", "decode_queue", "decode")


def free_port() -> int:
    return pick_free_port()


@dataclass
class UpCluster:
    """One ``pdcluster up`` process and the node/router pids it printed. Invariant: after ``stop`` returns, ``up``
    has exited; if it would not stop by itself, its printed children's process groups (``up`` starts each child
    in a session of its own) were killed, then ``up`` itself."""

    up_args: list[str]  # after ``up``: topology and node flags (ports and log dir are added here)
    log: Path
    http_port: int
    grpc_port: int
    checkout: Path | None = None  # run ``up`` from this source tree (default: this one)
    proc: subprocess.Popen[bytes] | None = None
    children: dict[str, int] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "common.app.cli", "up", *self.up_args,
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--log-dir", str(self.log.parent / self.log.stem)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.checkout is not None:
            env["PYTHONPATH"] = f"{self.checkout}:{self.checkout / 'proto'}"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                         cwd=self.checkout)

    def wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            if READY_LINE in text:
                self.children = {m[1]: int(m[2]) for line in text.splitlines() if (m := CHILD_LINE.match(line))}
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdcluster up exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"no '{READY_LINE}' within {timeout_s:.0f} s; log {self.log}")

    def stop(self) -> int | None:
        """SIGINT ``up`` and wait; returns its exit code (0: it stopped every child itself)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        for pid in (self.children or {}).values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        proc.kill()
        return proc.wait(10)


def client_for(args: argparse.Namespace, cluster: UpCluster) -> Client:
    if args.api == "grpc":
        return GrpcClient(f"127.0.0.1:{cluster.grpc_port}", args.request_timeout)
    return OpenAIClient(f"http://127.0.0.1:{cluster.http_port}/v1", timeout_s=args.request_timeout)


async def warm_up(client: Client) -> None:
    """Four short requests, two at a time: the nodes' first forwards are not measured."""
    warm = make_workload(WorkloadConfig(kind="fixed", num_requests=4, input_len=32, output_len=4, seed=10**6))
    await run_load(client, warm, LoadShape(concurrency=2, time_limit_s=60, grace_s=30, progress=False))


async def drive(args: argparse.Namespace, cluster: UpCluster, wl: WorkloadConfig) -> tuple[list[RequestResult],
                                                                                            float]:
    client = client_for(args, cluster)
    try:
        if isinstance(client, OpenAIClient):
            await asyncio.wait_for(client.resolve_model(), 30)
        await warm_up(client)
        shape = LoadShape(concurrency=None if args.rate else args.concurrency, rate=args.rate,
                          time_limit_s=args.time_limit, grace_s=args.grace, seed=wl.seed, progress=False)
        run = await run_load(client, make_workload(wl), shape)
    finally:
        await client.close()
    return run.results, run.wall_s


def server_timing(results: list[RequestResult]) -> dict[str, float | None]:
    """Median seconds of the router's timing breakdown over successful requests (absent fields are skipped)."""
    out: dict[str, float | None] = {}
    for key in TIMING_KEYS:
        xs = [float(r.server_timing[key]) for r in results if r.ok and r.server_timing and key in r.server_timing]
        out[f"{key}_median_s"] = round(statistics.median(xs), 4) if xs else None
    return out


def key_metrics(summary: dict[str, Any], timing: dict[str, float | None]) -> dict[str, Any]:
    return {"ttft_p50_ms": summary["ttft"].get("p50_ms"), "ttft_p99_ms": summary["ttft"].get("p99_ms"),
            "itl_p50_ms": summary["itl"].get("p50_ms"), "itl_p99_ms": summary["itl"].get("p99_ms"),
            "output_tok_per_s": summary["output_token_throughput"], "request_per_s": summary["request_throughput"],
            "completed": summary["completed"], "failed": summary["failed"],
            "server_prefill_median_ms": None if timing["prefill_median_s"] is None
            else round(timing["prefill_median_s"] * 1000, 2)}


def median_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in runs[0]:
        xs = [r[m] for r in runs if r[m] is not None]
        out[m] = round(statistics.median(xs), 3) if xs else None
    return out


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    return machine() | {"cpu": cpu, "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                        "commit": commit or None}
