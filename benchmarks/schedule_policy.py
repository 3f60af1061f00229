"""Scheduling policies and priorities on a saturated colocated ``Engine`` (the tiny generated Llama, CPU).

Two workloads, each against its baseline measured in the same run:

  shared prefix   --systems system prompts x --users users each (prompt = system prompt + a user turn), shuffled,
                  all submitted at once to a KV cache smaller than the system prompts together. ``fcfs`` vs ``lpm``:
                  prompt tokens served from the radix cache, TTFT p50 (scheduler arrival -> first token), wall time.
  priorities      --batch low-priority requests submitted at once, then --interactive short high-priority requests
                  one every --gap-s while the batch runs. With --enable-priority-scheduling (priority 0 vs 100) vs
                  without (the same requests, no priority): TTFT p99 per class and output tokens/s of the whole run.

    .venv/bin/python -m benchmarks.schedule_policy                        # defaults: 8 x 64; 256 batch + 16 interactive
    .venv/bin/python -m benchmarks.schedule_policy --json benchmarks/results/schedule_policy.json

--pd: the same two workloads on one prefill + one decode node (``pdcluster serve``, tcp KV transfer) behind a router
on 127.0.0.1, sent through the router's OpenAI API (``/v1/completions``, streamed; ``priority`` in the extra body),
TTFT as the client sees it. Both configurations' clusters run side by side (started together, each idle while the
other is loaded). Shared prefix: once per cluster (--schedule-policy on both nodes); cached prompt tokens are the
prefill node's ``#cached-token`` log totals. Priorities: --repeats rounds, order alternating; the batch at t=0, the
interactive requests open loop every --gap-s; preemptions and recomputed tokens (a decode node's ``Prefill batch.``
lines: only retracted requests prefill there) from the nodes' logs, the router's timing breakdown per class.

    .venv/bin/python -m benchmarks.schedule_policy --pd --skip mixed --users 8 --json benchmarks/results/schedule_policy_pd_shared.json
    .venv/bin/python -m benchmarks.schedule_policy --pd --skip shared --batch 48 --interactive 8 --gap-s 0.5 --repeats 3

Ratios are what to read (this run's policy / this run's baseline); absolute figures depend on the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.ports import pick_free_port  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def engine(model: str, ns: argparse.Namespace, **flags: Any) -> Any:
    from common.node.engine import Engine

    return Engine(model_path=model, max_total_tokens=ns.max_total_tokens, max_running_requests=ns.max_running,
                  torch_num_threads=ns.threads, **flags)


def shared_prefix_prompts(ns: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(ns.seed)
    systems = [[rng.randrange(10, 1000) for _ in range(ns.system_len)] for _ in range(ns.systems)]
    prompts = [s + [rng.randrange(10, 1000) for _ in range(ns.user_len)] for s in systems for _ in range(ns.users)]
    rng.shuffle(prompts)
    return prompts


def mixed_prompts(ns: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """(batch, interactive) prompts."""
    rng = random.Random(ns.seed + 1)
    batch = [[rng.randrange(10, 1000) for _ in range(ns.batch_len)] for _ in range(ns.batch)]
    inter = [[rng.randrange(10, 1000) for _ in range(ns.interactive_len)] for _ in range(ns.interactive)]
    return batch, inter


def shared_prefix(model: str, ns: argparse.Namespace) -> dict[str, Any]:
    prompts = shared_prefix_prompts(ns)
    sp = {"max_new_tokens": ns.output_len, "temperature": 0.0, "ignore_eos": True}
    out: dict[str, Any] = {}
    for policy in ("fcfs", "lpm"):
        with engine(model, ns, schedule_policy=policy) as e:
            start = time.monotonic()
            results = e.generate(input_ids=prompts, sampling_params=sp, timeout=3600)
            wall = time.monotonic() - start
        ttfts = [r.timing.ttft for r in results]
        out[policy] = {"cached_tokens": sum(r.cached_tokens for r in results),
                       "prompt_tokens": sum(len(p) for p in prompts), "ttft_p50_s": statistics.median(ttfts),
                       "ttft_p99_s": percentile(ttfts, 0.99), "wall_s": wall}
        print(policy, json.dumps(out[policy]), flush=True)
    out["lpm_vs_fcfs"] = {"cached_tokens": out["lpm"]["cached_tokens"] / max(1, out["fcfs"]["cached_tokens"]),
                          "ttft_p50": out["lpm"]["ttft_p50_s"] / out["fcfs"]["ttft_p50_s"],
                          "wall": out["lpm"]["wall_s"] / out["fcfs"]["wall_s"]}
    return out


def mixed(model: str, ns: argparse.Namespace, priorities: bool) -> dict[str, Any]:
    batch, inter = mixed_prompts(ns)
    lo_sp = {"max_new_tokens": ns.batch_output_len, "temperature": 0.0, "ignore_eos": True}
    hi_sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    hi_ttft: list[float] = []
    lo: list[Any] = []
    with engine(model, ns, enable_priority_scheduling=priorities) as e:
        start = time.monotonic()
        runner = threading.Thread(target=lambda: lo.extend(e.generate(
            input_ids=batch, sampling_params=lo_sp, timeout=3600, priority=0 if priorities else None)))
        runner.start()
        time.sleep(ns.gap_s)
        for p in inter:
            r = e.generate(input_ids=p, sampling_params=hi_sp, timeout=3600, priority=100 if priorities else None)
            hi_ttft.append(r.timing.ttft)
            time.sleep(ns.gap_s)
        runner.join()
        wall = time.monotonic() - start
    lo_ttft = [r.timing.ttft for r in lo]
    tokens = sum(len(r.output_ids) for r in lo) + 4 * len(inter)
    return {"hi_ttft_p99_s": percentile(hi_ttft, 0.99), "lo_ttft_p99_s": percentile(lo_ttft, 0.99),
            "hi_ttft_p50_s": statistics.median(hi_ttft), "output_tok_s": tokens / wall, "wall_s": wall}


# -- --pd: one prefill + one decode node (``pdcluster up``) through the router's OpenAI API ---------------------------
PREFILL_LINE = re.compile(r"Prefill batch\. #new-seq: \d+, #new-token: (\d+), #cached-token: (\d+)")
PREEMPT_LINE = re.compile(r"Priority preemption: .* retracted (\d+) running requests")
RETRACT_LINE = re.compile(r"Decode batch\..*#retracted-req: (\d+)")


def log_counts(log: Path) -> dict[str, int]:
    """A node's totals from its log lines: prompt tokens computed (``#new-token``) and served from its radix cache
    (``#cached-token``) over its ``Prefill batch.`` lines, requests retracted by priority preemption and by memory
    pressure (``#retracted-req`` of ``Decode batch.`` lines, printed every --decode-log-interval steps)."""
    out = {"new_tokens": 0, "cached_tokens": 0, "preempted": 0, "retracted": 0}
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if m := PREFILL_LINE.search(line):
            out["new_tokens"] += int(m[1])
            out["cached_tokens"] += int(m[2])
        elif m := PREEMPT_LINE.search(line):
            out["preempted"] += int(m[1])
        elif m := RETRACT_LINE.search(line):
            out["retracted"] += int(m[1])
    return out


class PdRun:
    """One prefill node, one decode node (``pdcluster serve``, tcp KV transfer) and a router on 127.0.0.1, started
    by hand rather than by ``pdcluster up``: ``up`` forwards one --max-total-tokens to both nodes, and the decode
    node must not be the gate (a prefill node pops a request from bootstrap only once the decode node preallocated
    it, so a decode KV pool as small as the prefill node's keeps the prefill queue a few requests long and no policy
    has anything to order). ``flags`` go to both nodes; ``counts`` are the nodes' log totals since ``mark``. On exit
    each process is terminated by PID, then killed if it has not ended within 30 s."""

    def __init__(self, ns: argparse.Namespace, tag: str, flags: list[str]) -> None:
        self.ns, self.dir, self.flags = ns, ns.log_dir / tag, flags
        self.procs: list[subprocess.Popen[bytes]] = []
        self.base: dict[str, dict[str, int]] = {}
        self.http_port = pick_free_port()

    def _spawn(self, name: str, args: list[str]) -> None:
        with open(self.dir / f"{name}.log", "wb") as out:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "common.app.cli", *args], stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True,
                                               env={**os.environ, "PYTHONUNBUFFERED": "1"}))

    def start(self) -> None:
        self.dir.mkdir(parents=True)
        ns, model = self.ns, ["--model-path", self.ns.model]
        port, boot, dport = pick_free_port(), pick_free_port(), pick_free_port()
        node = [*model, "--host", "127.0.0.1", "--kv-transfer-backend", "tcp", "--torch-num-threads", str(ns.threads),
                *self.flags]
        self._spawn("prefill-0", ["serve", *node, "--port", str(port), "--disaggregation-mode", "prefill",
                                  "--disaggregation-bootstrap-port", str(boot), "--max-running-requests",
                                  str(ns.max_running), "--max-total-tokens", str(ns.max_total_tokens)])
        self._spawn("decode-0", ["serve", *node, "--port", str(dport), "--disaggregation-mode", "decode",
                                 "--max-running-requests", str(ns.decode_max_running),
                                 "--max-total-tokens", str(ns.decode_max_total_tokens)])
        self._spawn("router", ["router", *model, "--http-port", str(self.http_port), "--grpc-port",
                               str(pick_free_port()), "--prefill", f"127.0.0.1:{port}:{boot}", "--decode",
                               f"127.0.0.1:{dport}"])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ns.ready_timeout
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=2)
                return
            except OSError:
                if any(p.poll() is not None for p in self.procs):
                    break
                time.sleep(1.0)
        tails = "".join(f"\n--- {f.name}:\n" + f.read_text(errors="replace")[-1500:]
                        for f in sorted(self.dir.glob("*.log")))
        raise RuntimeError(f"cluster {self.dir.name} not ready within {self.ns.ready_timeout:.0f} s{tails}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def node_logs(self) -> dict[str, dict[str, int]]:
        return {node: log_counts(self.dir / f"{node}.log") for node in ("prefill-0", "decode-0")}

    def mark(self) -> None:
        self.base = self.node_logs()

    def counts(self) -> dict[str, dict[str, int]]:
        return {node: {k: v - self.base.get(node, {}).get(k, 0) for k, v in c.items()}
                for node, c in self.node_logs().items()}

    async def send_all(self, specs: list[Any], delays: list[float]) -> tuple[list[Any], float]:
        """Warm up, ``mark``, then send every spec at its delay (s) after the start, all at once (open loop);
        returns the results and the wall time from the start to the last one's end."""
        from benchmarks.loadgen.clients import OpenAIClient
        from benchmarks.up_runs import warm_up

        client = OpenAIClient(f"http://127.0.0.1:{self.http_port}/v1", timeout_s=self.ns.time_limit)
        try:
            await asyncio.wait_for(client.resolve_model(), 30)
            await warm_up(client)
            self.mark()
            t0 = time.perf_counter()

            async def at(spec: Any, delay: float) -> Any:
                await asyncio.sleep(delay)
                return await client.send(spec, t0)

            results = await asyncio.wait_for(asyncio.gather(*(at(s, d) for s, d in zip(specs, delays, strict=True))),
                                             self.ns.time_limit)
            wall = time.perf_counter() - t0
        finally:
            await client.close()
        if failed := [r for r in results if not r.ok]:
            raise RuntimeError(f"{len(failed)} requests failed ({failed[0].error}); logs in {self.ns.log_dir}")
        return results, wall


@contextlib.contextmanager
def pd_clusters(ns: argparse.Namespace, configs: dict[str, list[str]]) -> Iterator[dict[str, PdRun]]:
    """Both configurations' clusters at once (started together, idle while the other is loaded), so repeats
    alternate between them without restarting; every process is ended on exit."""
    runs = {tag: PdRun(ns, tag, flags) for tag, flags in configs.items()}
    try:
        for r in runs.values():
            r.start()
        for r in runs.values():
            r.wait_ready()
        yield runs
    finally:
        for r in runs.values():
            r.stop()


def pd_shared_prefix(run: PdRun, ns: argparse.Namespace, policy: str) -> dict[str, Any]:
    from benchmarks.loadgen.workload import RequestSpec

    specs = [RequestSpec(i, p, ns.output_len) for i, p in enumerate(shared_prefix_prompts(ns))]
    load = os.getloadavg()[0]
    results, wall = asyncio.run(run.send_all(specs, [0.0] * len(specs)))
    counts = run.counts()
    ttfts = [r.ttft for r in results]
    return {"policy": policy, "cached_tokens": counts["prefill-0"]["cached_tokens"],
            "prompt_tokens": sum(s.prompt_len for s in specs), "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": percentile(ttfts, 0.99), "wall_s": wall, "nodes": counts,
            "loadavg": [round(load, 2), round(os.getloadavg()[0], 2)]}


def pd_mixed(run: PdRun, ns: argparse.Namespace, priorities: bool, rep: int) -> dict[str, Any]:
    """The batch at once at t=0, one interactive request every --gap-s from t=gap (open loop: none waits for
    another). Without ``priorities`` the nodes run plain FCFS and no request carries a priority."""
    from benchmarks.loadgen.workload import RequestSpec
    from benchmarks.up_runs import server_timing

    batch, inter = mixed_prompts(ns)
    lo, hi = (0, 100) if priorities else (None, None)
    specs = [RequestSpec(i, p, ns.batch_output_len, "batch", priority=lo) for i, p in enumerate(batch)]
    specs += [RequestSpec(len(batch) + i, p, 4, "interactive", priority=hi) for i, p in enumerate(inter)]
    delays = [0.0] * len(batch) + [ns.gap_s * (i + 1) for i in range(len(inter))]
    load = os.getloadavg()[0]
    results, wall = asyncio.run(run.send_all(specs, delays))
    counts = run.counts()
    by = {k: [r.ttft for r in results if r.kind == k] for k in ("batch", "interactive")}
    return {"priorities": priorities, "rep": rep, "hi_ttft_p50_s": statistics.median(by["interactive"]),
            "hi_ttft_p99_s": percentile(by["interactive"], 0.99), "lo_ttft_p99_s": percentile(by["batch"], 0.99),
            "output_tok_s": sum(r.output_tokens for r in results) / wall, "wall_s": wall,
            "prompt_tokens": sum(s.prompt_len for s in specs), "nodes": counts,
            "server_timing": {k: server_timing([r for r in results if r.kind == k]) for k in by},
            "loadavg": [round(load, 2), round(os.getloadavg()[0], 2)]}


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def pd_main(ns: argparse.Namespace, report: dict[str, Any]) -> None:
    if "shared" not in ns.skip:  # once per cluster: a second pass would find the first one's prefixes cached
        with pd_clusters(ns, {p: ["--schedule-policy", p] for p in ("fcfs", "lpm")}) as runs:
            res = {p: pd_shared_prefix(runs[p], ns, p) for p in ("fcfs", "lpm")}
        for r in res.values():
            print("pd shared", json.dumps(r), flush=True)
        report["pd_shared_prefix"] = res | {"lpm_vs_fcfs": {
            "cached_tokens": res["lpm"]["cached_tokens"] / max(1, res["fcfs"]["cached_tokens"]),
            "ttft_p50": res["lpm"]["ttft_p50_s"] / res["fcfs"]["ttft_p50_s"],
            "wall": res["lpm"]["wall_s"] / res["fcfs"]["wall_s"]}}
        print("pd shared prefix, lpm / fcfs:", json.dumps(report["pd_shared_prefix"]["lpm_vs_fcfs"]), flush=True)
    if "mixed" not in ns.skip:  # repeats alternate the order (load drifts on a shared machine)
        runs_out: list[dict[str, Any]] = []
        with pd_clusters(ns, {"fcfs": [], "priority": ["--enable-priority-scheduling"]}) as runs:
            for rep in range(ns.repeats):
                for prio in (False, True) if rep % 2 == 0 else (True, False):
                    runs_out.append(pd_mixed(runs["priority" if prio else "fcfs"], ns, prio, rep))
                    print("pd mixed", json.dumps(runs_out[-1]), flush=True)
        pairs = [{r["priorities"]: r for r in runs_out if r["rep"] == rep} for rep in range(ns.repeats)]
        report["pd_priorities"] = {"runs": runs_out, "ratios": {
            "hi_p99_over_lo_p99": spread([p[True]["hi_ttft_p99_s"] / p[True]["lo_ttft_p99_s"] for p in pairs]),
            "hi_p99_vs_fcfs_hi_p99": spread([p[True]["hi_ttft_p99_s"] / p[False]["hi_ttft_p99_s"] for p in pairs]),
            "throughput_vs_fcfs": spread([p[True]["output_tok_s"] / p[False]["output_tok_s"] for p in pairs])}}
        print("pd priorities:", json.dumps(report["pd_priorities"]["ratios"]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the tiny generated Llama")
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=128)
    ap.add_argument("--user-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batch-len", type=int, default=64)
    ap.add_argument("--batch-output-len", type=int, default=32)
    ap.add_argument("--interactive", type=int, default=16)
    ap.add_argument("--interactive-len", type=int, default=16)
    ap.add_argument("--gap-s", type=float, default=0.2)
    ap.add_argument("--max-total-tokens", type=int, default=640, help="smaller than the system prompts together")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--decode-max-total-tokens", type=int, default=16384, help="--pd: the decode node's KV pool")
    ap.add_argument("--decode-max-running", type=int, default=128,
                    help="--pd: the decode node's running requests (--max-running is the prefill node's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pd", action="store_true", help="one prefill + one decode node (pdcluster up) via the router")
    ap.add_argument("--repeats", type=int, default=1, help="--pd: rounds of both configurations (order alternates)")
    ap.add_argument("--time-limit", type=float, default=240.0, help="--pd: seconds one configuration's load may take")
    ap.add_argument("--ready-timeout", type=float, default=180.0, help="--pd: seconds for the cluster to start")
    ap.add_argument("--skip", choices=("shared", "mixed"), action="append", default=[])
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    from common.text.tokenizer import resolve_model_path

    model = ns.model = str(resolve_model_path(ns.model_path))
    report: dict[str, Any] = {"args": vars(ns)}
    if ns.pd:
        from common.wire.security import CLUSTER_TOKEN_ENV, generate_cluster_token

        os.environ.setdefault(CLUSTER_TOKEN_ENV, generate_cluster_token())  # nodes and router share it
        with tempfile.TemporaryDirectory(prefix="schedule-policy-pd-") as tmp:
            ns.log_dir = Path(tmp)
            pd_main(ns, report)
        report["args"]["log_dir"] = None
        if ns.json:
            Path(ns.json).write_text(json.dumps(report, indent=1) + "\n")
        return
    if "shared" not in ns.skip:
        report["shared_prefix"] = shared_prefix(model, ns)
        print("shared prefix, lpm / fcfs:", json.dumps(report["shared_prefix"]["lpm_vs_fcfs"]), flush=True)
    if "mixed" not in ns.skip:
        fcfs, prio = mixed(model, ns, False), mixed(model, ns, True)
        report["priorities"] = {"fcfs": fcfs, "priority": prio, "ratios": {
            "hi_p99_over_lo_p99": prio["hi_ttft_p99_s"] / prio["lo_ttft_p99_s"],
            "hi_p99_vs_fcfs_hi_p99": prio["hi_ttft_p99_s"] / fcfs["hi_ttft_p99_s"],
            "throughput_vs_fcfs": prio["output_tok_s"] / fcfs["output_tok_s"]}}
        print("priorities:", json.dumps(report["priorities"], indent=1), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
