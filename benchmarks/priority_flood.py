"""An ordinary client's TTFT while another client floods at the top priority, with and without the router's
priority policy (issue 54), on one ``pdcluster up`` P/D cluster with ``--enable-priority-scheduling``.

The cluster's key file holds two keys: ``sk-ordinary`` under ``--max-client-priority 0`` and ``sk-unbounded`` with
``max_priority=2147483647`` (priorities as anyone's were before the policy). Phases, alternated ``--repeats`` times:

    idle       the ordinary client alone
    no-policy  flooders on sk-unbounded at priority 2147483647 (served at it: ahead of everyone, preempting)
    policy     the same flooders on sk-ordinary (over the ceiling: refused, or served at 0 with --over clamp)

The ordinary client sends priority 0 (its ceiling: under priority scheduling a request without one is the least
urgent of all) one request at a time, streamed; its TTFT is the time to the first content chunk. Flooders send back
to back, ``--flood`` at a time; after an error (a refusal) a flooder waits ``ERROR_PAUSE_S`` before its next request,
so a refused flood loads the router like a retrying client rather than a tight loop.

    python -m benchmarks.priority_flood --over refuse     # and --over clamp
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.bench import machine
from benchmarks.up_runs import UpCluster, free_port

ORDINARY, UNBOUNDED = "sk-ordinary-0123456789abcdef", "sk-unbounded-0123456789abcdef"
TOP = 2**31 - 1
ERROR_PAUSE_S = 0.1
REQUEST_TIMEOUT_S = 120.0
PROMPT = "Disaggregated serving splits prefill and decode across nodes. " * 4


async def ttft(s: aiohttp.ClientSession, url: str, key: str, priority: int, max_tokens: int) -> float | None:
    """Seconds to the first content chunk of one streamed completion (None: refused or failed)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "priority": priority, "ignore_eos": True}
    t0 = time.monotonic()
    async with s.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status != 200:
            await r.read()
            return None
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.monotonic() - t0
        return first


async def flooder(s: aiohttp.ClientSession, url: str, key: str, stop: asyncio.Event, counts: dict[str, int]) -> None:
    while not stop.is_set():
        try:
            got = await ttft(s, url, key, TOP, 64)
        except (aiohttp.ClientError, TimeoutError):
            got = None
        counts["served" if got is not None else "refused"] += 1
        if got is None:
            await asyncio.sleep(ERROR_PAUSE_S)


async def phase(url: str, flood_key: str | None, flood: int, samples: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        stop, counts = asyncio.Event(), {"served": 0, "refused": 0}
        tasks = [asyncio.create_task(flooder(s, url, flood_key, stop, counts)) for _ in range(flood if flood_key
                                                                                            else 0)]
        try:
            await asyncio.sleep(2.0 if tasks else 0.0)  # the flood fills the queues first
            got = [await ttft(s, url, ORDINARY, 0, 16) for _ in range(samples)]
        finally:
            stop.set()
            await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S) if tasks else None
            for t in tasks:
                t.cancel()
    ok = [x for x in got if x is not None]
    return {"ttft_ms": [round(x * 1000, 1) for x in ok], "failed": len(got) - len(ok), "flood": counts}


async def run(args: argparse.Namespace, cluster: UpCluster) -> dict[str, Any]:
    url = f"http://127.0.0.1:{cluster.http_port}/v1/completions"
    flood_key = {"idle": None, "no-policy": UNBOUNDED, "policy": ORDINARY}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in flood_key}
    await phase(url, None, 0, 4)  # warm-up: the nodes' first forwards are not measured
    for _ in range(args.repeats):
        for name, key in flood_key.items():
            runs[name].append(await phase(url, key, args.flood, args.samples))
    summary = {}
    for name, rs in runs.items():
        xs = [x for r in rs for x in r["ttft_ms"]]
        summary[name] = {"ttft_p50_ms": round(statistics.median(xs), 1) if xs else None,
                         "per_repeat_p50_ms": [round(statistics.median(r["ttft_ms"]), 1) if r["ttft_ms"] else None
                                               for r in rs],
                         "flood_served": sum(r["flood"]["served"] for r in rs),
                         "flood_refused": sum(r["flood"]["refused"] for r in rs)}
    idle = summary["idle"]["ttft_p50_ms"]
    for name in ("no-policy", "policy"):
        p50 = summary[name]["ttft_p50_ms"]
        summary[name]["vs_idle"] = round(p50 / idle, 2) if p50 and idle else None
    return {"summary": summary, "runs": runs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--over", choices=("refuse", "clamp"), default="refuse", help="the router's --client-priority-over")
    p.add_argument("--flood", type=int, default=8, help="flooders at a time")
    p.add_argument("--samples", type=int, default=6, help="ordinary requests per phase")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the three phases (alternated)")
    p.add_argument("--model-size", choices=("tiny", "small"), default="tiny", help="the embedded model's size")
    p.add_argument("--max-running-requests", type=int, default=4, help="each node's (contention comes sooner)")
    p.add_argument("--out", default=None, help="JSON results (default: benchmarks/results/priority_flood_<over>_<date>.json)")
    args = p.parse_args()
    from common.model_gen.make_model import default_model_path

    work = Path(tempfile.mkdtemp(prefix="priority-flood-"))
    keys = work / "keys"
    keys.write_text(f"{ORDINARY}\n{UNBOUNDED} max_priority={TOP}\n")
    cluster = UpCluster(["--prefill", "1", "--decode", "1", "--model-path", str(default_model_path(size=args.model_size)),
                         "--enable-priority-scheduling", "--max-running-requests", str(args.max_running_requests),
                         "--api-key-file", str(keys), "--max-client-priority", "0", "--client-priority-over", args.over],
                        work / "up.log", free_port(), free_port())
    cluster.start()
    try:
        cluster.wait_ready(300)
        result = asyncio.run(run(args, cluster))
    finally:
        with contextlib.suppress(Exception):
            cluster.stop()
    result["config"] = {**vars(args), "up_args": cluster.up_args}
    result["machine"] = machine()
    out = Path(args.out or Path(__file__).parent / "results" / f"priority_flood_{args.over}_{date.today()}.json")
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
