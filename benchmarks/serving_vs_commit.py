"""Serving throughput through ``pdcluster up`` against an earlier commit, in one sitting: the PD cluster (one prefill
and one decode node) and a colocated node behind the same router, each run from this checkout and from a ``git
worktree`` of ``--base`` (removed at the end), under the same workload.

    .venv/bin/python -m benchmarks.serving_vs_commit --base dee4d96 --repeats 2 --num-requests 96 --concurrency 32

Workload (issue 15): closed loop at ``--concurrency``, fixed ``--input-len`` -> ``--output-len`` tokens, streaming
through the router's OpenAI API (``--api grpc`` for gRPC), fresh prompts per repeat, the same for every
configuration. Each repeat runs the four configurations in an order that alternates, so load drift hits both
commits alike; the table holds medians over repeats and the ratio this checkout / base per topology. On CPU ``up``
gives every rank 1 torch thread unless ``--torch-num-threads``. Writes ``benchmarks/results/serving_vs_commit.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.loadgen.stats import summarize
from benchmarks.loadgen.workload import WorkloadConfig
from benchmarks.up_runs import (
    UpCluster,
    drive,
    free_port,
    key_metrics,
    machine_info,
    median_metrics,
    server_timing,
)

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = {"pd": ["--prefill", "1", "--decode", "1"], "colocated": ["--prefill", "0", "--decode", "0", "--colocated", "1"]}


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare with (e.g. where the work started)")
    ap.add_argument("--topologies", default="pd,colocated", help=f"comma-separated, of {', '.join(TOPOLOGIES)}")
    ap.add_argument("--model", default=None, help="model folder (default: generate the small llama, seed 0)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32, help="closed loop: requests in flight")
    ap.add_argument("--rate", type=float, default=None, help="open loop instead: Poisson arrivals, req/s")
    ap.add_argument("--api", choices=("openai", "grpc"), default="openai")
    ap.add_argument("--torch-num-threads", type=int, default=None, help="per rank (default: up's 1 on CPU)")
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for 'pdcluster ready'")
    ap.add_argument("--time-limit", type=float, default=180.0, help="seconds; no request starts after it")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds for in-flight requests after the limit")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serving_vs_commit.json"))
    args = ap.parse_args()
    args.topologies = args.topologies.split(",")
    if unknown := set(args.topologies) - set(TOPOLOGIES):
        ap.error(f"unknown topologies {sorted(unknown)}; choose from {', '.join(TOPOLOGIES)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def _git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()


def _run_one(args: argparse.Namespace, topology: str, checkout: Path | None, log: Path,
             wl: WorkloadConfig) -> dict[str, Any]:
    up_args = ["--model-path", args.model, *TOPOLOGIES[topology], "--max-total-tokens", str(args.max_total_tokens)]
    if args.torch_num_threads is not None:
        up_args += ["--torch-num-threads", str(args.torch_num_threads)]
    cluster = UpCluster(up_args, log, free_port(), free_port(), checkout)
    load_before = os.getloadavg()[0]
    try:
        cluster.start()
        cluster.wait_ready(args.ready_timeout)
        results, wall = asyncio.run(drive(args, cluster, wl))
    except BaseException:
        print(f"{log.stem} failed; up's log:\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr, flush=True)
        raise
    finally:
        up_rc = cluster.stop()
    summary = summarize(results, wall)
    timing = server_timing(results)
    return {"key": key_metrics(summary, timing), "server_timing": timing, "summary": summary,
            "up_exit_code": up_rc, "loadavg_before": round(load_before, 2),
            "loadavg_after": round(os.getloadavg()[0], 2)}


def main() -> int:
    args = _parse()
    base = _git("rev-parse", "--short", args.base)
    base_wl = WorkloadConfig(kind="fixed", num_requests=args.num_requests, input_len=args.input_len,
                             output_len=args.output_len, token_id_range=(100, 8000))
    with tempfile.TemporaryDirectory(prefix="serving-vs-") as tmp_name:
        tmp = Path(tmp_name)
        worktree = tmp / f"base-{base}"
        _git("worktree", "add", "--detach", str(worktree), base)
        try:
            if args.model is None:
                from common.model_gen.make_model import make_model

                args.model = str(make_model("llama", "small", tmp / "model", seed=0))
            info = machine_info()
            print(f"machine {info}; base {base}; model {args.model}", flush=True)
            configs = {f"{t}@{c}": (t, None if c == "head" else worktree) for t in args.topologies
                       for c in ("head", "base")}
            per_run: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
            for rep in range(args.repeats):
                wl = replace(base_wl, seed=rep)
                order = list(configs) if rep % 2 == 0 else list(configs)[::-1]
                for name in order:
                    topology, checkout = configs[name]
                    t0 = time.monotonic()
                    run = _run_one(args, topology, checkout, tmp / f"{name.replace('@', '-')}-r{rep}.log", wl)
                    per_run[name].append(run | {"repeat": rep, "seconds": round(time.monotonic() - t0, 1)})
                    print(f"repeat {rep} {name}: {json.dumps(run['key'])} (load {run['loadavg_before']:.1f})",
                          flush=True)
        finally:
            _git("worktree", "remove", "--force", str(worktree))
    medians = {c: median_metrics([r["key"] for r in runs]) for c, runs in per_run.items()}
    ratios = {t: {m: (round(medians[f"{t}@head"][m] / medians[f"{t}@base"][m], 3)
                      if medians[f"{t}@head"][m] and medians[f"{t}@base"][m] else None)
                  for m in medians[f"{t}@base"]} for t in args.topologies}
    report = {"benchmark": "serving_vs_commit", "base": base, "config": vars(args),
              "workload": asdict(base_wl) | {"seed": "repeat index"},
              "machine": info | {"loadavg_end": round(os.getloadavg()[0], 2)},
              "medians": medians, "ratio_head_vs_base": ratios, "runs": per_run}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    cols = ("request_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "completed", "failed")
    print("| config | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 1) + "|")
    rows = {**medians, **{f"ratio {t} head/base": r for t, r in ratios.items()}}
    for c, k in rows.items():
        print(f"| {c} | " + " | ".join(str(k[m]) for m in cols) + " |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
