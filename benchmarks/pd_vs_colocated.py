"""Disaggregated P/D versus one colocated node on this 2-core machine, same model, same router, same workload.

    (a) colocated   one node on cores 0-1, 2 torch threads, no chunked prefill (--chunked-prefill-size -1)
    (b) chunked     one node on cores 0-1, 2 torch threads, --chunked-prefill-size C --enable-mixed-chunk
    (c) pd          prefill node on core 0, decode node on core 1 (``taskset -c N``: the scheduler rank children
                    inherit the affinity), 1 torch thread each, tcp KV transfer

Workload (``pdcluster bench`` library, open loop, Poisson): steady short requests plus every k-th request a long
prompt (default 2000 tokens). Reports decode ITL p99 (of the short requests), TTFT p99 and goodput under the SLOs,
and the ratios of (c) and (b) to (a). Writes JSON and a CDF plot. The router and the load generator are not pinned.

    .venv/bin/python -m benchmarks.pd_vs_colocated --rate 3 --num-requests 90
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.bench import machine
from benchmarks.loadgen.clients import OpenAIClient
from benchmarks.loadgen.plots import write_plots
from benchmarks.loadgen.runner import LoadShape, run_load
from benchmarks.loadgen.stats import RequestResult, Slo, summarize
from benchmarks.loadgen.workload import WorkloadConfig, make_workload
from common.ports import pick_free_port as free_port

CONFIGS = ("colocated", "chunked", "pd")


def _serve(cores: str, mode: str, threads: int, extra: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port, boot = free_port(), free_port()
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "common.app.cli", "serve", "--model-path", ARGS.model,
           "--host", "127.0.0.1", "--port", str(port), "--disaggregation-mode", mode,
           "--disaggregation-bootstrap-port", str(boot), "--kv-transfer-backend", "tcp",
           "--torch-num-threads", str(threads), "--max-total-tokens", str(ARGS.max_total_tokens), *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    addr = f"127.0.0.1:{port}" + (f":{boot}" if mode == "prefill" else "")
    return proc, addr


def _start(config: str, tmp: Path) -> tuple[list[subprocess.Popen[bytes]], str]:
    # P/D nodes refuse to start without the cluster secret: one per run, shared with the router through the env
    os.environ.setdefault("PDCLUSTER_CLUSTER_TOKEN", secrets.token_hex(16))
    procs: list[subprocess.Popen[bytes]] = []
    if config == "pd":
        p, paddr = _serve("0", "prefill", 1, [], tmp / "prefill.log")
        d, daddr = _serve("1", "decode", 1, [], tmp / "decode.log")
        procs += [p, d]
        workers = ["--prefill", paddr, "--decode", daddr]
    else:
        extra = (["--chunked-prefill-size", "-1"] if config == "colocated"
                 else ["--chunked-prefill-size", str(ARGS.chunk_size), "--enable-mixed-chunk"])
        c, caddr = _serve("0,1", "null", 2, extra, tmp / "colocated.log")
        procs.append(c)
        workers = ["--worker", caddr]
    http = free_port()
    router = subprocess.Popen([sys.executable, "-m", "common.app.cli", "router", "--model-path", ARGS.model,
                               "--http-port", str(http), "--grpc-port", str(free_port()), *workers],
                              stdout=open(tmp / "router.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    procs.append(router)
    url = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return procs, url + "/v1"
        except OSError:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.5)
    _stop(procs)
    raise RuntimeError(f"{config}: cluster not ready; logs in {tmp}")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


async def _load(url: str, slo: Slo) -> tuple[list[RequestResult], dict[str, Any]]:
    wl = WorkloadConfig(kind="mixed", num_requests=ARGS.num_requests, input_len=ARGS.short_len,
                        output_len=ARGS.output_len, range_ratio=0.5, long_input_len=ARGS.long_len,
                        long_output_len=4, long_every=ARGS.long_every, token_id_range=(100, 8000))
    client = OpenAIClient(url)
    await client.resolve_model()
    warm = make_workload(WorkloadConfig(kind="fixed", num_requests=4, input_len=32, output_len=4))
    await run_load(client, warm, LoadShape(concurrency=2, progress=False))
    run = await run_load(client, make_workload(wl), LoadShape(concurrency=None, rate=ARGS.rate,
                                                              time_limit_s=ARGS.time_limit, grace_s=60))
    await client.close()
    return run.results, summarize(run.results, run.wall_s, slo)


def _key(s: dict[str, Any]) -> dict[str, Any]:
    short = s["by_kind"].get("short", {})
    return {"decode_itl_p99_ms": short.get("itl", {}).get("p99_ms"), "ttft_p99_ms": s["ttft"].get("p99_ms"),
            "goodput": s["goodput"], "completed": s["completed"], "errors": s["errors"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded small model)")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--rate", type=float, default=3.0, help="requests/s, Poisson")
    ap.add_argument("--num-requests", type=int, default=90)
    ap.add_argument("--short-len", type=int, default=128, help="short prompts: [len/2, len] tokens")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--long-every", type=int, default=10)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=250.0)
    ap.add_argument("--out", default="benchmarks/results/pd_vs_colocated")
    global ARGS
    ARGS = ap.parse_args()
    from common.text.tokenizer import resolve_model_path

    ARGS.model = str(resolve_model_path(ARGS.model))
    slo = Slo(ARGS.slo_ttft_ms / 1000, ARGS.slo_itl_ms / 1000)
    series: dict[str, list[RequestResult]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    for config in ARGS.configs:
        with tempfile.TemporaryDirectory(prefix=f"pdvc-{config}-") as tmp:
            procs, url = _start(config, Path(tmp))
            try:
                print(f"== {config} (loadavg {os.getloadavg()[0]:.1f})", flush=True)
                series[config], summaries[config] = asyncio.run(_load(url, slo))
            finally:
                _stop(procs)
        print(json.dumps(_key(summaries[config])), flush=True)
    ratios: dict[str, Any] = {}
    if "colocated" in summaries:
        base = _key(summaries["colocated"])
        for c in summaries:
            k = _key(summaries[c])
            ratios[c] = {m: (round(k[m] / base[m], 3) if k[m] and base[m] else None)
                         for m in ("decode_itl_p99_ms", "ttft_p99_ms", "goodput")}
    out = Path(ARGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plots = write_plots(series, out)
    report = {"benchmark": "pd_vs_colocated", "config": vars(ARGS), "machine": machine(),
              "key": {c: _key(s) for c, s in summaries.items()}, "ratios_vs_colocated": ratios,
              "summaries": summaries, "plots": [str(p) for p in plots]}
    out.with_name(out.name + ".json").write_text(json.dumps(report, indent=1) + "\n")
    print("| config | decode ITL p99 ms | TTFT p99 ms | goodput req/s | ITL ratio | TTFT ratio | goodput ratio |")
    print("|---|---|---|---|---|---|---|")
    for c, s in summaries.items():
        k, r = _key(s), ratios.get(c, {})
        print(f"| {c} | {k['decode_itl_p99_ms']} | {k['ttft_p99_ms']} | {k['goodput']} | "
              f"{r.get('decode_itl_p99_ms')} | {r.get('ttft_p99_ms')} | {r.get('goodput')} |")
    print(f"wrote {out}.json, " + ", ".join(str(p) for p in plots))
    return 0


ARGS = argparse.Namespace()

if __name__ == "__main__":
    sys.exit(main())
