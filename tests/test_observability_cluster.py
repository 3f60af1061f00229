"""Observability on a real disaggregated cluster (router + prefill + decode processes, tiny model, tcp backend):
``pdcluster bench`` runs against it and writes JSON and PNG; the timing breakdown is present and adds up; the
router's and nodes' Prometheus metrics exist and move when traffic flows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from openai import OpenAI

from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.model_fixtures import make_tiny_model
from tests.node_helpers import Node, free_port, start_node

pytestmark = pytest.mark.slow

PARTS = ("router_queue", "bootstrap", "queue", "prefill", "transfer", "ttft_other")


@dataclass
class Cluster:
    prefill: Node
    decode: Node
    router: subprocess.Popen[str]
    http: str
    grpc_addr: str
    metrics: dict[str, str]  # node name -> metrics URL


def _metric_ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    model = make_tiny_model("llama")
    pm, dm = _metric_ports()
    p = start_node("prefill", model, extra=["--metrics-port", str(pm)], wait=False)
    d = start_node("decode", model, extra=["--metrics-port", str(dm)], wait=False)
    procs: list[subprocess.Popen[str]] = []
    try:
        p.wait_ready()
        d.wait_ready()
        http_port, grpc_port = free_port(), free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "common.app.cli", "router", "--model-path", str(model), "--http-port",
             str(http_port), "--grpc-port", str(grpc_port), "--prefill", f"127.0.0.1:{p.port}:{p.bootstrap_port}",
             "--decode", f"127.0.0.1:{d.port}", "--health-interval", "0.5"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        procs.append(router)
        assert router.stdout is not None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and "router ready" not in (line := router.stdout.readline()):
            assert line, "router exited before it was ready"
        base = f"http://127.0.0.1:{http_port}"
        while time.monotonic() < deadline:  # until both workers are routable
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        yield Cluster(p, d, router, base, f"127.0.0.1:{grpc_port}",
                      {"prefill": f"http://127.0.0.1:{pm}/metrics", "decode": f"http://127.0.0.1:{dm}/metrics"})
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        p.stop()
        d.stop()


def _get(url: str) -> bytes:
    """GET with the admin credential (the router's internal views need it; node metrics ports ignore it)."""
    headers = {"Authorization": f"Bearer {os.environ['PDCLUSTER_CLUSTER_TOKEN']}"}
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5).read()


def scrape(url: str) -> dict[str, float]:
    text = _get(url).decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def total(samples: dict[str, float], name: str) -> float:
    """Sum of a metric over its label sets (``name`` or ``name{...}``)."""
    return sum(v for k, v in samples.items() if re.fullmatch(re.escape(name) + r"(\{.*\})?", k))


def bench_cli(cmd: list[str]) -> int:
    """``pdcluster bench`` in this process (the same parser and code path, without a new interpreter)."""
    from benchmarks.bench import run_bench
    from common.app.cli import build_parser

    return run_bench(build_parser().parse_args(cmd[cmd.index("bench"):]))


def test_bench_cli_writes_json_and_png(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "common.app.cli", "bench", "--base-url", cluster.http + "/v1", "--workload", "random",
           "--num-requests", "10", "--input-len", "40", "--output-len", "6", "--concurrency", "4",
           "--time-limit", "60", "--grace", "30", "--slo-ttft-ms", "5000", "--slo-itl-ms", "2000",
           "--no-progress", "--out", str(out)]
    assert bench_cli(cmd) == 0
    rep = json.loads(out.with_suffix(".json").read_text())
    s = rep["summary"]
    assert (s["requests"], s["completed"], s["errors"]) == (10, 10, {})
    assert s["ttft"]["n"] == 10 and s["e2e"]["p99_ms"] >= s["ttft"]["p99_ms"] > 0
    assert s["itl"]["n"] > 0 and s["output_token_throughput"] > 0 and s["goodput"] <= s["request_throughput"]
    assert sum(q["output_tokens"] for q in rep["requests"]) >= 10 * 3  # random output lengths in [3, 6]
    assert rep["requests"][0]["server_timing"]["transfer_bytes"] > 0
    for png in rep["plots"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the gRPC API, open loop
    cmd = [sys.executable, "-m", "common.app.cli", "bench", "--grpc", cluster.grpc_addr, "--num-requests", "5",
           "--input-len", "24", "--output-len", "4", "--rate", "20", "--time-limit", "30", "--no-progress",
           "--no-plots", "--out", str(tmp_path / "grpc")]
    assert bench_cli(cmd) == 0
    s = json.loads((tmp_path / "grpc.json").read_text())["summary"]
    assert s["completed"] == 5 and s["output_token_throughput"] > 0


def test_timing_breakdown_adds_up_to_e2e(cluster: Cluster) -> None:
    client = OpenAI(base_url=cluster.http + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    rid = f"obs-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    resp = client.completions.create(model=model, prompt=list(range(100, 180)), max_tokens=8,
                                     extra_body={"ignore_eos": True}, extra_headers={"X-Request-ID": rid})
    measured = time.perf_counter() - t0
    t = resp.model_extra["pdcluster"]["timing"]
    for k in (*PARTS, "decode_queue", "ttft", "e2e", "decode", "transfer_bytes"):
        assert k in t, k
    assert t["transfer_bytes"] > 0 and t["prefill"] > 0 and t["transfer"] > 0
    for k in PARTS[:-1]:
        assert t[k] >= 0, (k, t)
    # the parts make up TTFT: what no phase accounts for (RPC/IPC hops) is small next to it
    assert sum(t[k] for k in PARTS) == pytest.approx(t["ttft"], abs=1e-6)
    assert -0.02 <= t["ttft_other"] <= 0.05 + 0.5 * t["ttft"], t
    assert t["ttft"] + t["decode"] == pytest.approx(t["e2e"], abs=1e-6)
    assert t["e2e"] <= measured <= t["e2e"] + 0.5, (measured, t)  # what the client saw, less HTTP overhead
    looked_up = json.loads(_get(f"{cluster.http}/v1/requests/{rid}/timing"))
    assert looked_up["timing"]["e2e"] == t["e2e"]
    # gRPC: the final message carries the same breakdown
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.grpc_addr))
    sp = common_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0)
    msgs = list(stub.Generate(router_pb2.RouterGenerateRequest(input_ids=router_pb2.TokenIds(ids=list(range(100, 150))),
                                                               sampling_params=sp), timeout=60))
    timing = msgs[-1].complete.timing
    assert timing.transfer_bytes > 0 and timing.prefill > 0 and 0 < timing.ttft <= timing.e2e


ROUTER_MOVING = ("pdcluster_router_ttft_seconds_count", "pdcluster_router_itl_seconds_count",
                 "pdcluster_router_e2e_seconds_count", "pdcluster_router_requests_total",
                 "pdcluster_router_dispatches_total", "pdcluster_router_prompt_tokens_total",
                 "pdcluster_router_completion_tokens_total")
ROUTER_PRESENT = ("pdcluster_router_retries_total", "pdcluster_router_aborts_total",
                  "pdcluster_router_inflight_requests", "pdcluster_router_worker_healthy")
NODE_MOVING = {
    "prefill": ("pdcluster_node_requests_total", "pdcluster_node_kv_transfer_bytes_count",
                "pdcluster_node_kv_transfer_seconds_count",
                "pdcluster_node_kv_transfer_bandwidth_bytes_per_second_count", "pdcluster_node_queue_seconds_count"),
    "decode": ("pdcluster_node_requests_total", "pdcluster_node_ttft_seconds_count",
               "pdcluster_node_e2e_seconds_count", "pdcluster_node_tpot_seconds_count",
               "pdcluster_node_kv_transfer_bytes_count"),
}
NODE_PRESENT = ("pdcluster_node_queue_requests", "pdcluster_node_token_usage_ratio", "pdcluster_node_free_kv_pages",
                "pdcluster_node_failures_total")


def test_metrics_exist_and_move_with_traffic(cluster: Cluster) -> None:
    before = {"router": scrape(cluster.http + "/metrics")} | {n: scrape(u) for n, u in cluster.metrics.items()}
    client = OpenAI(base_url=cluster.http + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    for i in range(3):
        stream = client.completions.create(model=model, prompt=list(range(200 + i, 260)), max_tokens=5, stream=True,
                                           extra_body={"ignore_eos": True})
        assert sum(1 for _ in stream) >= 2
    time.sleep(1.5)  # node queue gauges come from periodic load reports
    after = {"router": scrape(cluster.http + "/metrics")} | {n: scrape(u) for n, u in cluster.metrics.items()}
    for name in ROUTER_MOVING:
        assert total(after["router"], name) > total(before["router"], name), name
    for name in ROUTER_PRESENT:
        assert any(k.startswith(name) for k in after["router"]), name
    for node, names in NODE_MOVING.items():
        for name in names:
            assert total(after[node], name) > total(before[node], name), (node, name)
        for name in NODE_PRESENT:
            assert any(k.startswith(name) for k in after[node]), (node, name)
    queues = {m.group(1) for k in after["prefill"] | after["decode"]
              if (m := re.match(r'pdcluster_node_queue_requests\{.*queue="(\w+)"', k))}
    assert queues >= {"waiting", "running", "bootstrap", "inflight", "prealloc", "transfer"}
