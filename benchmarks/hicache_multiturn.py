"""Hierarchical cache (issue 52): multi-turn chat on one prefill + one decode node, with and without
``--enable-hierarchical-cache``; and a prefix shared by two prefill nodes through one storage tier.

Multi-turn: ``--users`` conversations of ``--turns`` turns; turn t of a user sends the whole history (its system
prompt, every earlier user message and assistant reply, the new user message) through the router's OpenAI API.
Requests go turn by turn over all users (the next turn of a user is sent once its previous one answered), at most
``--concurrency`` in flight: between two turns of a user every other user's turn passes, so with the prefill node's
device pool (``--max-total-tokens``) a quarter of the working set or less, a user's history is evicted from the
device before it comes back. The assistant replies in the history are fixed token runs (the same in both modes): a
prefill node never holds a reply's KV (the decode node computed it), so only their length matters to its cache.
Modes alternate (A/B/A/B...), the same requests in the same order each time. Per mode: prompt tokens served from a
cache (the router's ``pdcluster_router_cached_tokens_total``), TTFT p50/p99, requests and tokens per second.

Storage: ``--prefill 2`` on one file store, round robin: each of ``--shared-prompts`` prompts is sent twice in a row,
the first lands on one prefill node, the second on the other, which finds the first one's pages in the store;
reports the second's cached share of its prompt.

    python -m benchmarks.hicache_multiturn --repeats 2 --out benchmarks/results/hicache_multiturn.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.cache_routing import router_counter
from benchmarks.loadgen.clients import OpenAIClient
from benchmarks.loadgen.stats import RequestResult, summarize
from benchmarks.loadgen.workload import RequestSpec
from benchmarks.up_runs import UpCluster, free_port, machine_info
from common.wire.security import CLUSTER_TOKEN_ENV, generate_cluster_token

VOCAB = (20, 8000)  # token ids drawn for prompts (the small generated model's vocabulary is 8192)


def conversations(args: argparse.Namespace) -> list[list[list[int]]]:
    """Per user, per turn: the message tokens of that turn (the system prompt rides with turn 0)."""
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(*VOCAB) for _ in range(n)]  # noqa: E731
    return [[draw(args.system_len + args.user_len if t == 0 else args.user_len) for t in range(args.turns)]
            for _ in range(args.users)]


def reply(user: int, turn: int, n: int) -> list[int]:
    rng = random.Random(user * 1000 + turn)
    return [rng.randrange(*VOCAB) for _ in range(n)]


async def run_chat(client: OpenAIClient, args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    convs = conversations(args)
    history: list[list[int]] = [[] for _ in convs]
    results: list[RequestResult] = []
    sem = asyncio.Semaphore(args.concurrency)
    t0 = time.perf_counter()

    async def turn(user: int, t: int) -> None:
        async with sem:
            prompt = history[user] + convs[user][t]
            spec = RequestSpec(index=t * args.users + user, prompt_ids=prompt, max_tokens=args.reply_len,
                               kind=f"turn{t}")
            results.append(await client.send(spec, t0))
            history[user] = prompt + reply(user, t, args.reply_len)

    for t in range(args.turns):  # turn by turn over all users
        await asyncio.gather(*(turn(u, t) for u in range(args.users)))
    return results, time.perf_counter() - t0


async def drive_chat(cluster: UpCluster, args: argparse.Namespace) -> dict[str, Any]:
    client = OpenAIClient(f"http://127.0.0.1:{cluster.http_port}/v1", timeout_s=args.request_timeout)
    try:
        await asyncio.wait_for(client.resolve_model(), 30)
        warm = RequestSpec(index=0, prompt_ids=list(range(100, 164)), max_tokens=4)
        for _ in range(2):
            await client.send(warm, time.perf_counter())
        cached0 = router_counter(cluster, "pdcluster_router_cached_tokens_total")
        prompt0 = router_counter(cluster, "pdcluster_router_prompt_tokens_total")
        results, wall = await run_chat(client, args)
        cached = router_counter(cluster, "pdcluster_router_cached_tokens_total") - cached0
        prompt = router_counter(cluster, "pdcluster_router_prompt_tokens_total") - prompt0
    finally:
        await client.close()
    s = summarize(results, wall)
    host = sum(int((r.server_timing or {}).get("cached_tokens_host", 0)) for r in results if r.ok)
    return {"completed": s["completed"], "failed": s["failed"], "wall_s": s["wall_s"],
            "prompt_tokens": int(prompt), "cached_tokens": int(cached), "cached_tokens_host": host,
            "ttft_p50_ms": s["ttft"].get("p50_ms"), "ttft_p99_ms": s["ttft"].get("p99_ms"),
            "request_per_s": s["request_throughput"], "total_tok_per_s": s["total_token_throughput"]}


def node_flags(args: argparse.Namespace, hicache: bool) -> list[str]:
    flags = ["--max-total-tokens", str(args.max_total_tokens), "--torch-num-threads", str(args.torch_num_threads)]
    if args.model:
        flags += ["--model-path", args.model]
    if hicache:
        flags += ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio)]
    return flags


def run_mode(hicache: bool, args: argparse.Namespace, tmp: Path, rep: int) -> dict[str, Any]:
    name = "hicache" if hicache else "baseline"
    cluster = UpCluster(["--prefill", "1", "--decode", "1", *node_flags(args, hicache)],
                        tmp / f"{name}-r{rep}.log", free_port(), free_port())
    load_before = os.getloadavg()[0]
    cluster.start()
    try:
        cluster.wait_ready(args.ready_timeout)
        out = asyncio.run(drive_chat(cluster, args))
    finally:
        code = cluster.stop()
    return {"mode": name, "rep": rep, **out, "up_exit": code, "loadavg_before": round(load_before, 2),
            "loadavg_after": round(os.getloadavg()[0], 2)}


def run_shared_store(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    store = tmp / "store"
    extra = json.dumps({"file_path": str(store), "prefetch_threshold": 64})
    cluster = UpCluster(["--prefill", "2", "--decode", "1", "--prefill-policy", "round_robin",
                         *node_flags(args, True), "--hicache-storage-backend", "file",
                         "--hicache-storage-prefetch-policy", "wait_complete",
                         "--hicache-storage-backend-extra-config", extra], tmp / "store.log", free_port(), free_port())
    cluster.start()
    rows = []
    try:
        cluster.wait_ready(args.ready_timeout)
        rng = random.Random(args.seed + 1)
        base = f"http://127.0.0.1:{cluster.http_port}/v1"
        model = get_json(f"{base}/models", None, args.request_timeout)["data"][0]["id"]
        for i in range(args.shared_prompts):
            prompt = [rng.randrange(*VOCAB) for _ in range(args.shared_len)]
            pair = []
            for _ in range(2):
                body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
                r = get_json(f"{base}/completions", body, args.request_timeout)
                ext = r.get("pdcluster", {})
                pair.append({"cached": r["usage"]["prompt_tokens_details"]["cached_tokens"],
                             "prefill": ext.get("served_by", ""), "timing": ext.get("timing", {})})
                time.sleep(args.store_settle)  # the first one's pages are written behind
            second = pair[1]
            rows.append({"prompt": i, "prompt_tokens": len(prompt), "first_cached": pair[0]["cached"],
                         "second_cached": second["cached"], "served_by": [p["prefill"] for p in pair],
                         "second_storage_tokens": second["timing"].get("cached_tokens_storage", 0),
                         "second_cached_share": round(second["cached"] / len(prompt), 3)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        cluster.stop()
    return {"pairs": rows, "median_second_cached_share": statistics.median(r["second_cached_share"] for r in rows)}


def get_json(url: str, body: dict[str, Any] | None, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    out: dict[str, float | None] = {}
    for key, name in (("cached_tokens", "cached_x"), ("ttft_p50_ms", "ttft_p50_x"), ("total_tok_per_s", "throughput_x")):
        base = med("baseline", key)
        out[name] = round(med("hicache", key) / base, 3) if base else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: up's embedded model)")
    p.add_argument("--repeats", type=int, default=2, help="rounds; each runs both modes (order alternates)")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=64)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--reply-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--max-total-tokens", type=int, default=8192, help="each node's device KV pool (tokens)")
    p.add_argument("--hicache-ratio", type=float, default=6.0)
    p.add_argument("--torch-num-threads", type=int, default=1)
    p.add_argument("--shared-prompts", type=int, default=4)
    p.add_argument("--shared-len", type=int, default=1024)
    p.add_argument("--store-settle", type=float, default=1.0, help="seconds between the two sends of a prompt")
    p.add_argument("--skip-store", action="store_true")
    p.add_argument("--seed", type=int, default=52)
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault(CLUSTER_TOKEN_ENV, generate_cluster_token())  # to read the router's /metrics
    per_user = args.system_len + args.turns * args.user_len + (args.turns - 1) * args.reply_len
    print(f"working set {args.users * per_user} tokens = {args.users * per_user / args.max_total_tokens:.1f}x the "
          "prefill node's device pool", flush=True)
    info = machine_info()
    rows: list[dict[str, Any]] = []
    store: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="hicache-bench-") as d:
        for rep in range(args.repeats):
            for hicache in ((False, True) if rep % 2 == 0 else (True, False)):
                rows.append(run_mode(hicache, args, Path(d), rep))
                print(json.dumps(rows[-1]), flush=True)
        if not args.skip_store:
            store = run_shared_store(args, Path(d))
    summary = {"ratios_hicache_over_baseline": ratios(rows), "shared_store": store and {
        k: v for k, v in store.items() if k != "pairs"}}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "machine": info,
                                        "runs": rows, "shared_store": store, **summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
