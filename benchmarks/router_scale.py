"""Router at scale: 2, 8, 32 and 64 mock workers (half prefill, half decode) behind one router.

Two measurements per fleet size N:
  decide  the routing decision in this process, on one thread: ``RouterCore._route`` (candidates with free KV,
          the prefill policy, the decode policy, DP ranks, leases, a bootstrap room) over a registry of N workers
          holding load reports, with ``--window`` decisions outstanding (their leases released oldest first, so
          in-flight counts move). Decisions/s = decisions / wall time of that loop.
  e2e     ``pdcluster router`` (its own process, pinned to CPU 0 with taskset when there are 2+ CPUs) in front of
          N mocks packed in one process (N grpc.aio servers; ``common.testing.mock_worker``, with ``--service-time``
          and ``--kv-pages`` of KV capacity each), pinned to the other CPUs with the client. A closed loop at
          ``--concurrency``, direct (a colocated mock in the same process) then through the router, back to back:
          router req/s (each request is one routing decision: a P and a D), added p50/p99 latency, and the router's
          CPU per request from /proc/PID/stat (which includes its health and load polling of N workers; the
          polling alone is sampled for ``--idle`` seconds first and also reported per second and subtracted).
          Then the added latency without queueing: ``--latency-requests`` each, direct then routed, started at a
          fixed ``--rate`` (open loop, well below what either path serves).

    .venv/bin/python -m benchmarks.router_scale --workers 2 8 32 64 --requests 1500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.router_overhead import PROMPT, _closed_loop, _cpu_s, _cpu_split, _pin, _spawn, _stop  # noqa: E402
from common.engine.sampling.params import SamplingParams  # noqa: E402
from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
from router.config import RouterConfig, WorkerSpec  # noqa: E402
from router.core import RouterCore  # noqa: E402
from router.metrics import RouterMetrics  # noqa: E402
from router.request import GenRequest  # noqa: E402
from router.workers import Registry  # noqa: E402

PAGE_SIZE = 16


# -- the packed mock fleet (a child process) ------------------------------------------------------------------------
async def serve_fleet(prefill: int, decode: int, colocated: int, service_time: float, kv_pages: int,
                      chunk_tokens: int) -> None:
    """N grpc.aio Worker servers in this process; prints their addresses as one JSON line, serves until SIGTERM."""
    import signal

    from common.gc_freeze import freeze_startup_heap
    from common.testing.mock_fleet import start_fleet

    workers = await start_fleet(prefill, decode, colocated, service_time=service_time, total_kv_pages=kv_pages,
                                page_size=PAGE_SIZE, chunk_tokens=chunk_tokens)
    # A gen-2 collection of this process's start-up heap paused all N mocks at a time (in the direct and the routed
    # phases alike): noise in both p99s, not the router's. The router freezes its own the same way.
    freeze_startup_heap()
    print(json.dumps({role: [w.address for w in workers if w.cfg.role == role]
                      for role in ("prefill", "decode", "colocated")}), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    for w in workers:
        await w.stop()


# -- decide: the routing decision in-process ---------------------------------------------------------------------
def _prompts(n: int, groups: int, length: int, rng: random.Random) -> list[list[int]]:
    """``n`` prompts of ``length`` ids: ``groups`` shared 3/4-length prefixes, each with its own tail."""
    prefixes = [[rng.randrange(5, 1500) for _ in range(length * 3 // 4)] for _ in range(groups)]
    return [prefixes[i % groups] + [rng.randrange(5, 1500) for _ in range(length - length * 3 // 4)]
            for i in range(n)]


async def measure_decisions(n_workers: int, decisions: int, window: int, kv_pages: int,
                            prefill_policy: str, decode_policy: str) -> dict[str, Any]:
    half = max(1, n_workers // 2)
    specs = [WorkerSpec(f"127.0.0.1:{20000 + i}", "prefill", 7000 + i) for i in range(half)]
    specs += [WorkerSpec(f"127.0.0.1:{21000 + i}", "decode") for i in range(half)]
    cfg = RouterConfig(workers=tuple(specs), prefill_policy=prefill_policy, decode_policy=decode_policy)
    registry = Registry(cfg)
    rng = random.Random(0)
    for spec in specs:
        w, _ = registry.add(spec)
        w.admit()
        mode = "prefill" if spec.role == "prefill" else "decode"
        assert w.set_info(worker_pb2.ServerInfo(mode=mode, page_size=PAGE_SIZE, dp_size=1, bootstrap_port=7000,
                                                context_len=4096, max_total_tokens=kv_pages * PAGE_SIZE))
        w.healthy = True
        free = rng.randrange(kv_pages // 2, kv_pages)
        w.set_load(worker_pb2.GetLoadResponse(page_size=PAGE_SIZE, ranks=[worker_pb2.RankLoad(
            dp_rank=0, running=rng.randrange(0, 8), waiting=rng.randrange(0, 4), free_kv_pages=free,
            total_kv_pages=kv_pages, token_usage=1 - free / kv_pages)]))
    core = RouterCore(cfg, None, None, RouterMetrics(), registry)  # type: ignore[arg-type]  # routing only
    prompts = _prompts(512, 8, 256, rng)
    now = time.monotonic()
    reqs = [GenRequest(f"r{i}", "grpc", p, SamplingParams(max_new_tokens=64), common_pb2.SamplingParams(),
                       False, now, now + 60) for i, p in enumerate(prompts)]
    outstanding: deque[Any] = deque()
    none: set[str] = set()
    spread: dict[str, int] = {}

    def run(n: int) -> None:
        for i in range(n):
            req = reqs[i % len(reqs)]
            plan = core._route(req, none, len(req.input_ids))
            spread[plan.worker.address] = spread.get(plan.worker.address, 0) + 1
            outstanding.append(plan)
            if len(outstanding) > window:
                old = outstanding.popleft()
                for lease in old.leases:
                    lease.release()
                core.rooms.release(old.room)

    run(min(decisions, 2000))  # warm-up: fills the prefix index
    spread.clear()
    t0, c0 = time.perf_counter(), time.process_time()
    run(decisions)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    while outstanding:
        old = outstanding.popleft()
        for lease in old.leases:
            lease.release()
        core.rooms.release(old.room)
    inflight = sum(w.inflight for w in registry)
    await registry.close()
    return {"decisions": decisions, "decisions_per_s": round(decisions / wall),
            "cpu_us_per_decision": round(cpu / decisions * 1e6, 1), "decode_workers_used": len(spread),
            "inflight_after": inflight}


# -- e2e: through the router process -------------------------------------------------------------------------------
async def _open_loop(call: Any, n: int, rate: float) -> dict[str, float]:
    """``n`` calls started at a fixed ``rate`` (not waiting for each other): latency without self-made queueing."""
    import statistics

    latencies: list[float] = []

    async def one(at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        t0 = time.perf_counter()
        await call()
        latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(one(start + i / rate) for i in range(n)))
    qs = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"requests": n, "rate": rate, "p50_ms": round(qs[49] * 1000, 3), "p99_ms": round(qs[98] * 1000, 3)}


async def _e2e(ns: argparse.Namespace, fleet: dict[str, list[str]], router_addr: str, router_pid: int,
               concurrency: int) -> dict[str, Any]:
    import grpc

    sp = common_pb2.SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=0)
    n_ch = max(1, concurrency // 8)
    opts = [("grpc.use_local_subchannel_pool", 1)]
    direct_chs = [grpc.aio.insecure_channel(fleet["colocated"][0], options=opts) for _ in range(n_ch)]
    router_chs = [grpc.aio.insecure_channel(router_addr, options=opts) for _ in range(n_ch)]
    workers = [worker_pb2_grpc.WorkerStub(c) for c in direct_chs]
    routers = [router_pb2_grpc.RouterStub(c) for c in router_chs]
    seq = iter(range(10**9))
    from common.text.tokenizer import load_tokenizer

    prompt_ids = load_tokenizer(Path(ns.model)).encode(PROMPT)

    async def direct() -> None:
        i = next(seq)
        req = worker_pb2.GenerateRequest(rid=f"d{i}", input_ids=prompt_ids, sampling_params=sp)
        async for _ in workers[i % n_ch].Generate(req):
            pass

    async def via_router() -> None:
        i = next(seq)
        req = router_pb2.RouterGenerateRequest(text=f"{i % 64} {PROMPT}", sampling_params=sp)
        done = 0
        async for m in routers[i % n_ch].Generate(req):
            done += m.HasField("complete")
        assert done == 1

    idle0, t_idle = _cpu_s(router_pid), time.perf_counter()
    await asyncio.sleep(ns.idle)  # the router's own health and load polling of N workers, no requests
    poll_cpu_per_s = (_cpu_s(router_pid) - idle0) / (time.perf_counter() - t_idle)
    await _closed_loop(direct, ns.warmup, concurrency, ns.time_limit)
    d = await _closed_loop(direct, ns.requests, concurrency, ns.time_limit)
    await _closed_loop(via_router, ns.warmup, concurrency, ns.time_limit)
    cpu0 = _cpu_s(router_pid)
    r = await _closed_loop(via_router, ns.requests, concurrency, ns.time_limit)
    cpu = _cpu_s(router_pid) - cpu0
    od = await _open_loop(direct, ns.latency_requests, ns.rate)
    orr = await _open_loop(via_router, ns.latency_requests, ns.rate)
    for c in direct_chs + router_chs:
        await c.close()
    return {"direct": d, "router": r, "router_req_per_s": r["rps"],
            "added_p50_ms": round(r["p50_ms"] - d["p50_ms"], 3), "added_p99_ms": round(r["p99_ms"] - d["p99_ms"], 3),
            "open_direct": od, "open_router": orr,
            "open_added_p50_ms": round(orr["p50_ms"] - od["p50_ms"], 3),
            "open_added_p99_ms": round(orr["p99_ms"] - od["p99_ms"], 3),
            "router_cpu_us_per_request": round(cpu / r["requests"] * 1e6, 1),
            "poll_cpu_ms_per_s": round(poll_cpu_per_s * 1e3, 1),
            "router_cpu_us_per_request_less_polling": round(
                (cpu - poll_cpu_per_s * r["wall_s"]) / r["requests"] * 1e6, 1),
            "router_cpu_util": round(cpu / r["wall_s"], 2), "loadavg": Path("/proc/loadavg").read_text().strip()}


def run_e2e(ns: argparse.Namespace, n_workers: int, env: dict[str, str]) -> dict[str, Any]:
    from common.ports import pick_free_port

    router_cpus, other_cpus = _cpu_split("")
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)
    half = max(1, n_workers // 2)
    mock_cmd = [*_pin(other_cpus), sys.executable, "-m", "benchmarks.router_scale", "--serve-fleet",
                "--prefill", str(half), "--decode", str(half), "--service-time", str(ns.service_time),
                "--kv-pages", str(ns.kv_pages), "--max-new-tokens", str(ns.max_new_tokens)]
    mocks, line = _spawn(mock_cmd, "{", env)
    router = None
    try:
        fleet = json.loads(line)
        port = pick_free_port()
        cmd = [*_pin(router_cpus), sys.executable, "-m", "common.app.cli", "router", "--model-path", ns.model,
               "--grpc-port", str(port), "--http-port", "-1", "--prefill-policy", ns.prefill_policy,
               "--decode-policy", ns.decode_policy]
        for a in fleet["prefill"]:
            cmd += ["--prefill", a]
        for a in fleet["decode"]:
            cmd += ["--decode", a]
        router, _ = _spawn(cmd, "router ready", env)
        time.sleep(ns.settle)  # every worker proven and probed (the router reports ready before that)
        return asyncio.run(_e2e(ns, fleet, f"127.0.0.1:{port}", router.pid, ns.concurrency))
    finally:
        if router is not None:
            _stop(router)
        _stop(mocks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 8, 32, 64], help="fleet sizes (P + D)")
    ap.add_argument("--requests", type=int, default=1500, help="e2e requests per phase")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--service-time", type=float, default=0.02, help="mock prefill time, seconds")
    ap.add_argument("--kv-pages", type=int, default=4096, help="each mock's KV capacity, pages of 16 tokens")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--decisions", type=int, default=20000, help="in-process routing decisions per fleet size")
    ap.add_argument("--window", type=int, default=256, help="in-process decisions outstanding")
    ap.add_argument("--prefill-policy", default="cache_aware")
    ap.add_argument("--decode-policy", default="power_of_two")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between router ready and the first request")
    ap.add_argument("--rate", type=float, default=50.0, help="open-loop arrivals/s of the latency phase")
    ap.add_argument("--latency-requests", type=int, default=500, help="requests per open-loop latency phase")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of router CPU sampled with no requests")
    ap.add_argument("--time-limit", type=float, default=90.0, help="per phase, seconds")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router_scale.json"))
    # the mock fleet child
    ap.add_argument("--serve-fleet", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prefill", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--decode", type=int, default=1, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.serve_fleet:
        asyncio.run(serve_fleet(ns.prefill, ns.decode, 1, ns.service_time, ns.kv_pages, ns.max_new_tokens))
        return 0

    from common.testing.mock_fleet import make_model_dir
    from common.wire.security import CLUSTER_TOKEN_ENV, generate_cluster_token

    env = {**os.environ, "PDCLUSTER_LOG_LEVEL": "WARNING", "PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}"}
    env.setdefault(CLUSTER_TOKEN_ENV, generate_cluster_token())
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="router-scale-") as tmp:
        ns.model = str(make_model_dir(Path(tmp) / "mock-model"))
        for n in ns.workers:
            row: dict[str, Any] = {"workers": n}
            row["decide"] = asyncio.run(measure_decisions(n, ns.decisions, ns.window, ns.kv_pages,
                                                          ns.prefill_policy, ns.decode_policy))
            if not ns.skip_e2e:
                row["e2e"] = run_e2e(ns, n, env)
            print(json.dumps(row), flush=True)
            runs.append(row)
    report = {"benchmark": "router_scale", "config": {k: v for k, v in vars(ns).items() if k not in ("model",)},
              "cpus": os.cpu_count(), "runs": runs, "loadavg_at_end": Path("/proc/loadavg").read_text().strip()}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(runs))
    print(f"wrote {out}")
    return 0


def format_table(runs: list[dict[str, Any]]) -> str:
    lines = ["| workers | decisions/s (in-process) | us CPU/decision | router req/s (e2e, c) | added p50/p99 ms "
             "(c) | added p50/p99 ms (open loop) | router CPU us/req | polling CPU ms/s | CPU us/req less polling "
             "| loadavg |", "|" + "---|" * 10]
    for r in runs:
        d, e = r["decide"], r.get("e2e")
        e2e = (f"{e['router_req_per_s']} | {e['added_p50_ms']} / {e['added_p99_ms']} | "
               f"{e['open_added_p50_ms']} / {e['open_added_p99_ms']} | "
               f"{e['router_cpu_us_per_request']} | {e['poll_cpu_ms_per_s']} | "
               f"{e['router_cpu_us_per_request_less_polling']} | {e['loadavg'].split()[0]}"
               ) if e else "- | - | - | - | - | - | -"
        lines.append(f"| {r['workers']} | {d['decisions_per_s']} | {d['cpu_us_per_decision']} | {e2e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
