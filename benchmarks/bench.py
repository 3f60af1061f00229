"""``pdcluster bench``: load the router's OpenAI (default) or gRPC API and report latency, throughput, goodput.

    pdcluster bench --base-url http://127.0.0.1:8000/v1 --workload fixed --input-len 128 --output-len 32 \
        --num-requests 200 --concurrency 16 --slo-ttft-ms 500 --slo-itl-ms 100 --out benchmarks/results/bench
    pdcluster bench --grpc 127.0.0.1:50051 --rate 8 --workload mixed --long-every 10 --long-input-len 2000

Writes ``<out>.json`` (config, summary, per-request records) and ``<out>_cdf.png`` / ``<out>_itl_time.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.loadgen.clients import Client, GrpcClient, OpenAIClient
from benchmarks.loadgen.plots import write_plots
from benchmarks.loadgen.runner import LoadShape, RunResult, run_load
from benchmarks.loadgen.stats import Slo, summarize
from benchmarks.loadgen.workload import KINDS, WorkloadConfig, make_workload
from common import env


def add_bench_args(p: argparse.ArgumentParser) -> None:
    t = p.add_mutually_exclusive_group()
    t.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the router's OpenAI base URL")
    t.add_argument("--grpc", default=None, metavar="HOST:PORT", help="use the router's gRPC API instead")
    p.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None,
                   help="the router's API key (default: PDCLUSTER_API_KEY / PDCLUSTER_API_KEY_FILE, else none)")
    p.add_argument("--tls-ca", default=None, help="CA bundle of a TLS router's certificate (https / gRPC TLS)")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = e2e, no ITL)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=KINDS, default="fixed", help="prompt and output lengths, and what they share")
    w.add_argument("--num-requests", type=int, default=100, help="requests sent in all")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    w.add_argument("--output-len", type=int, default=16, help="fixed via ignore_eos")
    w.add_argument("--range-ratio", type=float, default=0.5, help="random/mixed: lengths in [len*(1-r), len]")
    w.add_argument("--long-input-len", type=int, default=2000, help="mixed: long-context prompt length")
    w.add_argument("--long-output-len", type=int, default=8, help="mixed: long requests' output tokens")
    w.add_argument("--long-every", type=int, default=10, help="mixed: every k-th request is long")
    w.add_argument("--chat", action="store_true", help="mixed: short requests are chat turns")
    w.add_argument("--groups", type=int, default=4, help="shared-prefix: number of prefixes")
    w.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens of each prefix")
    w.add_argument("--token-id-range", type=int, nargs=2, default=(100, 1500), metavar=("LO", "HI"),
                   help="prompt token ids are drawn from [LO, HI)")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload's prompts and lengths")
    lo = p.add_argument_group("load (bounded by --num-requests and --time-limit)")
    lo.add_argument("--concurrency", type=int, default=16, help="closed loop: requests in flight")
    lo.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals, req/s")
    lo.add_argument("--time-limit", type=float, default=120.0, help="seconds; no request starts after it")
    lo.add_argument("--grace", type=float, default=30.0, help="seconds for in-flight requests after the limit")
    lo.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    lo.add_argument("--no-progress", action="store_true", help="no progress line while it runs")
    s = p.add_argument_group("SLOs for goodput")
    s.add_argument("--slo-ttft-ms", type=float, default=None, help="a request within it counts toward goodput")
    s.add_argument("--slo-itl-ms", type=float, default=None, help="... and its gaps between tokens within this")
    s.add_argument("--slo-itl-quantile", type=float, default=1.0, help="1.0: every gap of a request")
    p.add_argument("--out", default="benchmarks/results/bench", help="output prefix for .json and .png files")
    p.add_argument("--no-plots", action="store_true", help="write the JSON only")


def workload_from_args(ns: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        kind=ns.workload, num_requests=ns.num_requests, input_len=ns.input_len, output_len=ns.output_len,
        range_ratio=ns.range_ratio, long_input_len=ns.long_input_len, long_output_len=ns.long_output_len,
        long_every=ns.long_every, chat=ns.chat, groups=ns.groups, prefix_len=ns.prefix_len,
        token_id_range=tuple(ns.token_id_range), seed=ns.seed,
    )


def slo_from_args(ns: argparse.Namespace) -> Slo:
    ms = lambda v: None if v is None else v / 1000  # noqa: E731
    return Slo(ms(ns.slo_ttft_ms), ms(ns.slo_itl_ms), ns.slo_itl_quantile)


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


async def bench(client: Client, wl: WorkloadConfig, shape: LoadShape) -> RunResult:
    """Library entry point: run one workload with one load shape (the client is not closed)."""
    return await run_load(client, make_workload(wl), shape)


def report(run: RunResult, slo: Slo, config: dict[str, Any], records: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"config": config, "machine": machine(), "summary": summarize(run.results, run.wall_s, slo)}
    if records:
        out["requests"] = [asdict(r) for r in run.results]
    return out


async def _run(ns: argparse.Namespace) -> dict[str, Any]:
    timeout = ns.request_timeout
    client: Client
    api_key = ns.api_key if ns.api_key is not None else env.api_key()
    if ns.grpc:
        client = GrpcClient(ns.grpc, timeout, stream=not ns.no_stream, api_key=api_key, tls_ca=ns.tls_ca)
    else:
        oc = OpenAIClient(ns.base_url, ns.model, timeout, stream=not ns.no_stream, api_key=api_key,
                          tls_ca=ns.tls_ca)
        await oc.resolve_model()
        client = oc
    shape = LoadShape(None if ns.rate else ns.concurrency, ns.rate, ns.time_limit, ns.grace, ns.seed,
                      not ns.no_progress)
    wl = workload_from_args(ns)
    try:
        run = await bench(client, wl, shape)
    finally:
        await client.close()
    config = {"target": ns.grpc or ns.base_url, "api": "grpc" if ns.grpc else "openai", "stream": not ns.no_stream,
              "workload": asdict(wl), "load": asdict(shape), "started_at": time.time() - run.wall_s}
    rep = report(run, slo_from_args(ns), config)
    if not ns.no_plots:
        rep["plots"] = [str(p) for p in write_plots({"run": run.results}, Path(ns.out))]
    return rep


def run_bench(ns: argparse.Namespace) -> int:
    rep = asyncio.run(_run(ns))
    out = Path(ns.out + ".json") if not ns.out.endswith(".json") else Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1) + "\n")
    s = rep["summary"]
    print(format_summary(s))
    print(f"wrote {out}" + "".join(f", {p}" for p in rep.get("plots", [])))
    return 0 if s["completed"] else 1


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"requests {s['completed']}/{s['requests']} ok in {s['wall_s']} s; errors {s['errors'] or 'none'}",
        f"throughput {s['request_throughput']} req/s, {s['output_token_throughput']} out tok/s, "
        f"{s['total_token_throughput']} total tok/s; goodput {s['goodput']} req/s "
        f"({s['good_requests']} within SLO {s['slo']})",
        f"{'metric':6s} {'mean':>9s} {'p50':>9s} {'p90':>9s} {'p99':>9s}  (ms)",
    ]
    for k in ("ttft", "itl", "tpot", "e2e"):
        d = s[k]
        if d.get("n"):
            lines.append(f"{k:6s} " + " ".join(f"{d[q]:9.2f}" for q in ("mean_ms", "p50_ms", "p90_ms", "p99_ms")))
    return "\n".join(lines)
