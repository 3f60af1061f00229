"""P/D with a tensor-parallel prefill node: ``pdcluster up`` with prefill tp T (default 2) -> decode tp 1, versus
prefill tp 1 -> decode tp 1, same model, same workload, same sitting, driven through the router by the
``pdcluster bench`` library.

Each repeat starts one cluster per configuration (``python -m common.app.cli up --prefill 1 --decode 1
--prefill-tp-size T --decode-tp-size 1``), waits for its ``pdcluster ready`` line, sends a short warm-up and then
the repeat's workload (fixed lengths, fresh prompts per repeat, identical for both configurations), and stops it
with SIGINT. The order of the two configurations alternates per repeat so load drift on a shared machine hits
both alike; the report holds every repeat and the medians over repeats.

    .venv/bin/python -m benchmarks.pd_tp --repeats 2 --num-requests 30 --input-len 256 --output-len 16

Per configuration: TTFT p50/p99, ITL p50/p99, output tok/s, request throughput (client side) and the router's
per-request timing breakdown (median seconds in the prefill queue, in prefill, in KV transfer, in decode). On CPU
``up`` gives every rank 1 torch thread unless ``--torch-num-threads`` is set. The prefill node's TP collective
share is not exported by a node (it is ``TPGroup.comm_seconds`` inside the rank);
``benchmarks.engine_throughput --tp-size 2`` measures it for the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: generate the small llama, seed 0)")
    ap.add_argument("--prefill-tp-size", type=int, default=2, help="the prefill node's tp in the TP configuration")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=30)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4, help="closed loop: requests in flight")
    ap.add_argument("--rate", type=float, default=None, help="open loop instead: Poisson arrivals, req/s")
    ap.add_argument("--api", choices=("openai", "grpc"), default="openai", help="the router API the client uses")
    ap.add_argument("--torch-num-threads", type=int, default=None, help="per rank (default: up's 1 on CPU)")
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for 'pdcluster ready'")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds; no request starts after it")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds for in-flight requests after the limit")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--out", default="benchmarks/results/pd_tp.json")
    args = ap.parse_args()
    if args.prefill_tp_size < 2 or args.repeats < 1:
        ap.error("--prefill-tp-size must be >= 2 and --repeats >= 1")
    return args


def main() -> int:
    args = _parse()
    configs = {f"p_tp{args.prefill_tp_size}": args.prefill_tp_size, "p_tp1": 1}
    base_wl = WorkloadConfig(kind="fixed", num_requests=args.num_requests, input_len=args.input_len,
                             output_len=args.output_len, token_id_range=(100, 8000))
    with tempfile.TemporaryDirectory(prefix="pdtp-") as tmp_name:
        tmp = Path(tmp_name)
        if args.model is None:
            from common.model_gen.make_model import make_model

            args.model = str(make_model("llama", "small", tmp / "model", seed=0))
        info = machine_info()
        print(f"machine {info}; model {args.model}", flush=True)
        per_run: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        for rep in range(args.repeats):
            wl = replace(base_wl, seed=rep)
            order = list(configs) if rep % 2 == 0 else list(configs)[::-1]
            for name in order:
                up_args = ["--model-path", args.model, "--prefill", "1", "--decode", "1", "--prefill-tp-size",
                           str(configs[name]), "--decode-tp-size", "1", "--max-total-tokens", str(args.max_total_tokens)]
                if args.torch_num_threads is not None:
                    up_args += ["--torch-num-threads", str(args.torch_num_threads)]
                cluster = UpCluster(up_args, tmp / f"{name}-r{rep}.log", free_port(), free_port())
                load_before = os.getloadavg()[0]
                t0 = time.monotonic()
                try:
                    cluster.start()
                    cluster.wait_ready(args.ready_timeout)
                    ready_s = time.monotonic() - t0
                    results, wall = asyncio.run(drive(args, cluster, wl))
                except BaseException:
                    print(f"{name} repeat {rep} failed; up's log:\n{cluster.log.read_text(errors='replace')[-3000:]}",
                          file=sys.stderr, flush=True)
                    raise
                finally:
                    up_rc = cluster.stop()
                summary = summarize(results, wall)
                timing = server_timing(results)
                key = key_metrics(summary, timing)
                per_run[name].append({"repeat": rep, "key": key, "server_timing": timing, "summary": summary,
                                      "ready_s": round(ready_s, 1), "up_exit_code": up_rc,
                                      "loadavg_before": round(load_before, 2),
                                      "loadavg_after": round(os.getloadavg()[0], 2)})
                print(f"repeat {rep} {name}: {json.dumps(key)} (load {load_before:.1f})", flush=True)
    medians = {c: median_metrics([r["key"] for r in runs]) for c, runs in per_run.items()}
    tp_name = next(iter(configs))
    ratios = {m: (round(medians[tp_name][m] / medians["p_tp1"][m], 3) if medians[tp_name][m] and medians["p_tp1"][m]
                  else None) for m in medians["p_tp1"]}
    report = {"benchmark": "pd_tp", "config": vars(args), "workload": asdict(base_wl) | {"seed": "repeat index"},
              "machine": info | {"loadavg_end": round(os.getloadavg()[0], 2)},
              "prefill_tp_comm_share": "not exported by the node; see benchmarks.engine_throughput --tp-size 2",
              "medians": medians, f"ratio_{tp_name}_vs_p_tp1": ratios, "runs": per_run}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    cols = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tok_per_s", "request_per_s",
            "server_prefill_median_ms")
    print("| config | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 1) + "|")
    for c, k in {**medians, f"ratio {tp_name}/p_tp1": ratios}.items():
        print(f"| {c} | " + " | ".join(str(k[m]) for m in cols) + " |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
