"""P/D with a tensor-parallel prefill node: ``pdcluster up`` with prefill tp T (default 2) -> decode tp 1, versus
prefill tp 1 -> decode tp 1, same model, same workload, same sitting, driven through the router by the
``pdcluster bench`` library.

Each repeat starts one cluster per configuration (``python -m common.cli up --prefill 1 --decode 1
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
import contextlib
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.bench import machine
from benchmarks.loadgen.clients import Client, GrpcClient, OpenAIClient
from benchmarks.loadgen.runner import LoadShape, run_load
from benchmarks.loadgen.stats import RequestResult, summarize
from benchmarks.loadgen.workload import WorkloadConfig, make_workload

READY_LINE = "pdcluster ready"
CHILD_LINE = re.compile(r"^\s+(\S+)\s+pid (\d+)\s")
STOP_TIMEOUT_S = 60.0  # up's own stop: SIGTERM to its children, 20 s, then SIGKILL
TIMING_KEYS = ("queue", "bootstrap", "prefill", "transfer", "decode_queue", "decode")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class UpCluster:
    """One ``pdcluster up`` process and the node/router pids it printed. Invariant: after ``stop`` returns, ``up``
    has exited; if it would not stop by itself, its printed children's process groups (``up`` starts each child
    in a session of its own) were killed, then ``up`` itself."""

    prefill_tp: int
    log: Path
    http_port: int
    grpc_port: int
    proc: subprocess.Popen[bytes] | None = None
    children: dict[str, int] | None = None

    def start(self, args: argparse.Namespace) -> None:
        cmd = [sys.executable, "-m", "common.cli", "up", "--model-path", args.model, "--prefill", "1", "--decode", "1",
               "--prefill-tp-size", str(self.prefill_tp), "--decode-tp-size", "1",
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--log-dir", str(self.log.parent / self.log.stem), "--max-total-tokens", str(args.max_total_tokens)]
        if args.torch_num_threads is not None:
            cmd += ["--torch-num-threads", str(args.torch_num_threads)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

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


def _client(args: argparse.Namespace, cluster: UpCluster) -> Client:
    if args.api == "grpc":
        return GrpcClient(f"127.0.0.1:{cluster.grpc_port}", args.request_timeout)
    return OpenAIClient(f"http://127.0.0.1:{cluster.http_port}/v1", timeout_s=args.request_timeout)


async def _drive(args: argparse.Namespace, cluster: UpCluster, wl: WorkloadConfig) -> tuple[list[RequestResult],
                                                                                            float]:
    client = _client(args, cluster)
    try:
        if isinstance(client, OpenAIClient):
            await asyncio.wait_for(client.resolve_model(), 30)
        warm = make_workload(WorkloadConfig(kind="fixed", num_requests=4, input_len=32, output_len=4, seed=10**6))
        await run_load(client, warm, LoadShape(concurrency=2, time_limit_s=60, grace_s=30, progress=False))
        shape = LoadShape(concurrency=None if args.rate else args.concurrency, rate=args.rate,
                          time_limit_s=args.time_limit, grace_s=args.grace, seed=wl.seed, progress=False)
        run = await run_load(client, make_workload(wl), shape)
    finally:
        await client.close()
    return run.results, run.wall_s


def _server_timing(results: list[RequestResult]) -> dict[str, float | None]:
    """Median seconds of the router's timing breakdown over successful requests (absent fields are skipped)."""
    out: dict[str, float | None] = {}
    for key in TIMING_KEYS:
        xs = [float(r.server_timing[key]) for r in results if r.ok and r.server_timing and key in r.server_timing]
        out[f"{key}_median_s"] = round(statistics.median(xs), 4) if xs else None
    return out


def _key(summary: dict[str, Any], timing: dict[str, float | None]) -> dict[str, Any]:
    return {"ttft_p50_ms": summary["ttft"].get("p50_ms"), "ttft_p99_ms": summary["ttft"].get("p99_ms"),
            "itl_p50_ms": summary["itl"].get("p50_ms"), "itl_p99_ms": summary["itl"].get("p99_ms"),
            "output_tok_per_s": summary["output_token_throughput"], "request_per_s": summary["request_throughput"],
            "completed": summary["completed"], "failed": summary["failed"],
            "server_prefill_median_ms": None if timing["prefill_median_s"] is None
            else round(timing["prefill_median_s"] * 1000, 2)}


def _median_key(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in runs[0]:
        xs = [r[m] for r in runs if r[m] is not None]
        out[m] = round(statistics.median(xs), 3) if xs else None
    return out


def _machine() -> dict[str, Any]:
    import torch

    cpu = platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    return machine() | {"cpu": cpu, "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                        "commit": commit or None}


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
        info = _machine()
        print(f"machine {info}; model {args.model}", flush=True)
        per_run: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        for rep in range(args.repeats):
            wl = replace(base_wl, seed=rep)
            order = list(configs) if rep % 2 == 0 else list(configs)[::-1]
            for name in order:
                cluster = UpCluster(configs[name], tmp / f"{name}-r{rep}.log", _free_port(), _free_port())
                load_before = os.getloadavg()[0]
                t0 = time.monotonic()
                try:
                    cluster.start(args)
                    cluster.wait_ready(args.ready_timeout)
                    ready_s = time.monotonic() - t0
                    results, wall = asyncio.run(_drive(args, cluster, wl))
                except BaseException:
                    print(f"{name} repeat {rep} failed; up's log:\n{cluster.log.read_text(errors='replace')[-3000:]}",
                          file=sys.stderr, flush=True)
                    raise
                finally:
                    up_rc = cluster.stop()
                summary = summarize(results, wall)
                timing = _server_timing(results)
                key = _key(summary, timing)
                per_run[name].append({"repeat": rep, "key": key, "server_timing": timing, "summary": summary,
                                      "ready_s": round(ready_s, 1), "up_exit_code": up_rc,
                                      "loadavg_before": round(load_before, 2),
                                      "loadavg_after": round(os.getloadavg()[0], 2)})
                print(f"repeat {rep} {name}: {json.dumps(key)} (load {load_before:.1f})", flush=True)
    medians = {c: _median_key([r["key"] for r in runs]) for c, runs in per_run.items()}
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
