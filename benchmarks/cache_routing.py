"""Cache-aware vs round-robin prefill routing on the shared-prefix workload (issue 13 item 5).

For each policy: ``pdcluster up --prefill 2 --decode 1 --prefill-policy P`` with a KV pool per node too small to
cache every group's prefix (so where a group lands decides whether its prefix is still cached), the
``pdcluster bench`` library's ``shared-prefix`` workload (same seed, so the same requests in the same order)
closed-loop through the router's OpenAI API. Reports per policy:

- prefill cache hit rate vs ideal: prompt tokens served from a prefill node's prefix cache (the router's
  ``pdcluster_router_cached_tokens_total`` over the run; each prefill node's own ``#cached-token`` log counts
  beside it) over the ideal, where every request after its group's first reuses the whole ``--prefix-len``;
- TTFT p50/p99 (client side) and the median prefill time the router's timing breakdown reports;
- the load average before and after (the machine is shared: compare the policies only within one run).

    python -m benchmarks.cache_routing --num-requests 64 --out benchmarks/results/cache_routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.loadgen.clients import OpenAIClient
from benchmarks.loadgen.runner import LoadShape, run_load
from benchmarks.loadgen.stats import summarize
from benchmarks.loadgen.workload import WorkloadConfig, make_workload
from benchmarks.up_runs import UpCluster, free_port, machine_info
from common.wire.security import CLUSTER_TOKEN_ENV, generate_cluster_token

CACHED_LOG = re.compile(r"Prefill batch\..*#cached-token: (\d+)")


def router_counter(cluster: UpCluster, name: str) -> float:
    req = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/metrics",
                                 headers={"Authorization": f"Bearer {os.environ[CLUSTER_TOKEN_ENV]}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def node_cached_tokens(log_dir: Path) -> dict[str, int]:
    """Prompt tokens each prefill node served from its radix cache, from its batch log lines."""
    return {p.stem: sum(int(m.group(1)) for line in p.read_text(errors="replace").splitlines()
                        if (m := CACHED_LOG.search(line)))
            for p in sorted(log_dir.glob("prefill-*.log"))}


async def drive(cluster: UpCluster, args: argparse.Namespace) -> dict[str, Any]:
    client = OpenAIClient(f"http://127.0.0.1:{cluster.http_port}/v1", timeout_s=args.request_timeout)
    try:
        await asyncio.wait_for(client.resolve_model(), 30)
        warm = make_workload(WorkloadConfig(kind="fixed", num_requests=4, input_len=32, output_len=4, seed=10**6))
        await run_load(client, warm, LoadShape(concurrency=2, time_limit_s=120, grace_s=30, progress=False))
        log_dir = cluster.log.parent / cluster.log.stem
        cached0, prompt0, nodes0 = (router_counter(cluster, "pdcluster_router_cached_tokens_total"),
                                    router_counter(cluster, "pdcluster_router_prompt_tokens_total"),
                                    node_cached_tokens(log_dir))
        wl = WorkloadConfig(kind="shared-prefix", num_requests=args.num_requests, input_len=args.input_len,
                            output_len=args.output_len, groups=args.groups, prefix_len=args.prefix_len, seed=1)
        specs = make_workload(wl)
        run = await run_load(client, specs, LoadShape(concurrency=args.concurrency, time_limit_s=args.time_limit,
                                                      grace_s=60, progress=False))
        cached = router_counter(cluster, "pdcluster_router_cached_tokens_total") - cached0
        prompt = router_counter(cluster, "pdcluster_router_prompt_tokens_total") - prompt0
        nodes = {k: v - nodes0.get(k, 0) for k, v in node_cached_tokens(log_dir).items()}
    finally:
        await client.close()
    ok = {r.index for r in run.results if r.ok}
    seen: set[int] = set()
    reusers = 0  # completed requests after their group's first
    for s in specs:
        if s.index in ok:
            reusers += s.group in seen
            seen.add(s.group)  # type: ignore[arg-type]
    ideal = reusers * args.prefix_len
    summary = summarize(run.results, run.wall_s)
    prefill = [float(r.server_timing["prefill"]) for r in run.results
               if r.ok and r.server_timing and "prefill" in r.server_timing]
    return {"completed": summary["completed"], "failed": summary["failed"], "cached_tokens": int(cached),
            "prompt_tokens": int(prompt), "ideal_cached_tokens": ideal,
            "hit_rate_vs_ideal": round(cached / ideal, 3) if ideal else None,
            "node_cached_tokens": nodes, "ttft_p50_ms": summary["ttft"].get("p50_ms"),
            "ttft_p99_ms": summary["ttft"].get("p99_ms"), "e2e_p50_ms": summary["e2e"].get("p50_ms"),
            "prefill_median_ms": round(statistics.median(prefill) * 1000, 1) if prefill else None,
            "request_per_s": summary["request_throughput"]}


def run_policy(policy: str, args: argparse.Namespace, tmp: Path, rep: int) -> dict[str, Any]:
    up_args = ["--prefill", "2", "--decode", "1", "--prefill-policy", policy,
               "--max-total-tokens", str(args.max_total_tokens), "--torch-num-threads", str(args.torch_num_threads)]
    if args.model:
        up_args += ["--model-path", args.model]
    cluster = UpCluster(up_args, tmp / f"{policy}-r{rep}.log", free_port(), free_port())
    load_before = os.getloadavg()[0]
    cluster.start()
    try:
        cluster.wait_ready(args.ready_timeout)
        out = asyncio.run(drive(cluster, args))
    finally:
        code = cluster.stop()
    return {"policy": policy, "rep": rep, **out, "up_exit": code, "loadavg_before": round(load_before, 2),
            "loadavg_after": round(os.getloadavg()[0], 2)}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| policy | rep | hit rate vs ideal | cached / ideal tokens | per prefill node | TTFT p50 ms | TTFT p99 ms "
            "| prefill median ms | load avg before→after |\n|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['policy']} | {r['rep']} | {r['hit_rate_vs_ideal']} | {r['cached_tokens']} / {r['ideal_cached_tokens']} "
        f"| {' / '.join(str(v) for v in r['node_cached_tokens'].values())} | {r['ttft_p50_ms']:.0f} "
        f"| {r['ttft_p99_ms']:.0f} | {r['prefill_median_ms']} | {r['loadavg_before']}→{r['loadavg_after']} |\n"
        for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: up's embedded model)")
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    p.add_argument("--repeats", type=int, default=1, help="rounds; each runs every policy (order alternates)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--input-len", type=int, default=64, help="unique tokens after the shared prefix")
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=3072,
                   help="KV pool per node: holds about 5 of the 8 prefixes, so round robin's nodes thrash")
    p.add_argument("--torch-num-threads", type=int, default=1)
    p.add_argument("--time-limit", type=float, default=400)
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault(CLUSTER_TOKEN_ENV, generate_cluster_token())  # to read the router's /metrics
    info = machine_info()
    rows = []
    with tempfile.TemporaryDirectory(prefix="cache-routing-") as d:
        for rep in range(args.repeats):
            order = args.policies if rep % 2 == 0 else args.policies[::-1]
            for policy in order:
                rows.append(run_policy(policy, args, Path(d), rep))
                print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "machine": info,
                                        "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
