"""Router overhead: the router in PD mode in front of mock workers, versus calling a mock worker directly.

Mock workers (``common/testing/mock_worker.py``: the P/D pair in one process, since they rendezvous in-process, and the
colocated mock in another) answer after a fixed service time (default 20 ms). The same closed-loop gRPC client
(several channels, ``--concurrency`` in flight, ``--requests`` per phase after a warm-up) measures, back to back
at each concurrency,
  direct     client -> colocated mock ``Worker.Generate``
  router_pd  client -> router ``Router.Generate`` -> mock ``Prefill`` + mock ``Decode`` (concurrently)
and reports the added p50/p99 latency, the throughput ratio and the router's CPU time per request (from /proc,
summed over replicas). ``--modes grpc http``: the router leg through the gRPC API and/or through the HTTP gateway
(OpenAI ``/v1/completions`` with ``stream: true``, read to ``data: [DONE]``; CPU per request is then the gateway's,
the router process serving both). ``--replicas 1 2`` repeats it with N router processes sharing the ports
(SO_REUSEPORT). With 2+ CPUs the router processes are pinned with ``taskset`` to ``--router-cpus`` (default: CPU 0)
and the mocks and this client to the other CPUs, so the router never shares a core with them.
By default the mocks send all output tokens in one message and gRPC router requests are not streamed.

    .venv/bin/python -m benchmarks.router_overhead --requests 2000 --concurrency 1 32 --modes grpc http --replicas 1 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

PROMPT = "The router tokenizes this prompt, picks a prefill and a decode worker, and streams tokens back."


def _spawn(
    args: list[str], ready: str, env: dict[str, str], timeout: float = 90.0
) -> tuple[subprocess.Popen[str], str]:
    """Start a child and return it with its first stdout line that contains ``ready``."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{args[:4]} exited with {proc.wait()}")
        if ready in line:
            return proc, line.strip()
    proc.kill()
    raise RuntimeError(f"{args[:4]} not ready in {timeout} s")


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _closed_loop(
    call: Callable[[], Awaitable[None]], requests: int, concurrency: int, time_limit: float
) -> dict[str, float]:
    latencies: list[float] = []
    issued = 0
    deadline = time.monotonic() + time_limit

    async def client() -> None:
        nonlocal issued
        while issued < requests and time.monotonic() < deadline:
            issued += 1
            t0 = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    qs = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "requests": len(latencies),
        "wall_s": round(wall, 3),
        "rps": round(len(latencies) / wall, 1),
        "p50_ms": round(qs[49] * 1000, 3),
        "p90_ms": round(qs[89] * 1000, 3),
        "p99_ms": round(qs[98] * 1000, 3),
        "mean_ms": round(statistics.fmean(latencies) * 1000, 3),
    }


async def _measure(
    name: str, call: Callable[[], Awaitable[None]], ns: argparse.Namespace, warmup: bool = True
) -> dict[str, float]:
    if warmup:
        await _closed_loop(call, ns.warmup, ns.concurrency, ns.time_limit)
    out = await _closed_loop(call, ns.requests, ns.concurrency, ns.time_limit)
    print(f"{name:10s} {json.dumps(out)}", flush=True)
    return out


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _pids_cpu(pids: list[int]) -> float:
    return sum(_cpu_s(p) for p in pids)


async def _run_pair(
    ns: argparse.Namespace, direct_addr: str, router: tuple[str, str], prompt_ids: list[int], router_pids: list[int],
    concurrency: int, mode: str, floor: tuple[tuple[str, str], int] | None = None,
) -> dict[str, Any]:
    """Direct then via the router (``mode``: its gRPC API or its HTTP gateway) at one concurrency, back to back (so
    both see the same machine load), then the API floor (``floor``: its addresses and pid) when given.
    ``router``: (gRPC address, HTTP base URL)."""
    router_addr, http_url = router
    sp = common_pb2.SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=0)
    n_ch = max(1, concurrency // 8)  # one channel per 8 in-flight calls: one HTTP/2 connection serialises reads
    direct_chs = [grpc.aio.insecure_channel(direct_addr, options=[("grpc.use_local_subchannel_pool", 1)])
                  for _ in range(n_ch)]
    workers = [worker_pb2_grpc.WorkerStub(c) for c in direct_chs]
    seq = iter(range(10**9))

    async def direct() -> None:
        i = next(seq)
        req = worker_pb2.GenerateRequest(rid=f"d{i}", input_ids=prompt_ids, sampling_params=sp)
        n = 0
        async for m in workers[i % n_ch].Generate(req):
            n += m.HasField("finished")
        assert n == 1

    sub = argparse.Namespace(**{**vars(ns), "concurrency": concurrency})
    results: dict[str, Any] = {"mode": mode, "concurrency": concurrency,
                               "direct": await _measure(f"c={concurrency} direct", direct, sub)}
    async with _api_client(ns, mode, concurrency, router_addr, http_url) as call:
        await _closed_loop(call, ns.warmup, concurrency, ns.time_limit)
        cpu0 = _pids_cpu(router_pids)
        r = results["router_pd"] = await _measure(f"c={concurrency} {mode}", call, sub, warmup=False)
        results["router_cpu_us_per_request"] = round((_pids_cpu(router_pids) - cpu0) / r["requests"] * 1e6, 1)
    if floor is not None:  # the same client against handlers that do nothing, on the router's CPUs
        (floor_grpc, floor_http), floor_pid = floor
        async with _api_client(ns, mode, concurrency, floor_grpc, floor_http) as call:
            await _closed_loop(call, ns.warmup, concurrency, ns.time_limit)
            cpu0 = _cpu_s(floor_pid)
            f = results["floor"] = await _measure(f"c={concurrency} floor", call, sub, warmup=False)
            results["floor_cpu_us_per_request"] = round((_cpu_s(floor_pid) - cpu0) / f["requests"] * 1e6, 1)
    d = results["direct"]
    results["added_p50_ms"] = round(r["p50_ms"] - d["p50_ms"], 3)
    results["added_p99_ms"] = round(r["p99_ms"] - d["p99_ms"], 3)
    results["throughput_ratio"] = round(r["rps"] / d["rps"], 3)
    results["loadavg"] = round(os.getloadavg()[0], 2)
    for c in direct_chs:
        await c.close()
    return results


@contextlib.asynccontextmanager
async def _api_client(
    ns: argparse.Namespace, mode: str, concurrency: int, grpc_addr: str, http_url: str
) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """One request through the router's client API (``mode``: gRPC ``Router.Generate`` or streamed HTTP
    completions), read to its end; the connections live as long as the context."""
    import aiohttp

    sp = common_pb2.SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=0)
    n_ch = max(1, concurrency // 8)  # one channel per 8 in-flight calls: one HTTP/2 connection serialises reads
    chs = [grpc.aio.insecure_channel(grpc_addr, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(n_ch)]
    routers = [router_pb2_grpc.RouterStub(c) for c in chs]
    seq = iter(range(10**9))
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))
    body = {"model": "mock-model", "prompt": PROMPT, "max_tokens": ns.max_new_tokens, "temperature": 0,
            "stream": True}

    async def via_grpc() -> None:
        req = router_pb2.RouterGenerateRequest(text=PROMPT, sampling_params=sp, stream=ns.stream)
        done = 0
        async for m in routers[next(seq) % n_ch].Generate(req):
            done += m.HasField("complete")
        assert done == 1

    async def via_http() -> None:
        done = False
        async with http.post(f"{http_url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                done = done or line.startswith(b"data: [DONE]")
        assert done

    try:
        yield via_grpc if mode == "grpc" else via_http
    finally:
        for c in chs:
            await c.close()
        await http.close()


def _start_floor(env: dict[str, str], cpus: set[int] | None) -> tuple[subprocess.Popen[str], tuple[str, str], int]:
    """``benchmarks.api_floor`` on the router's CPUs: (proc, (gRPC address, HTTP base URL), pid)."""
    from common.ports import pick_free_port as free_port

    port, http_port = free_port(), free_port()
    cmd = [*_pin(cpus), sys.executable, "-m", "benchmarks.api_floor", "--grpc-port", str(port),
           "--http-port", str(http_port)]
    proc, _ = _spawn(cmd, "floor ready", env)
    return proc, (f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"), proc.pid


def _start_router(
    model: Path, fleet: dict[str, list[str]], replicas: int, env: dict[str, str], cpus: set[int] | None
) -> tuple[subprocess.Popen[str], tuple[str, str], list[int]]:
    """The router (``replicas`` processes sharing its ports), pinned to ``cpus``; (proc, (gRPC, HTTP), pids)."""
    from common.ports import pick_free_port as free_port

    port, http_port = free_port(), free_port()
    cmd = [*_pin(cpus), sys.executable, "-m", "common.app.cli", "router", "--model-path", str(model),
           "--grpc-port", str(port), "--http-port", str(http_port), "--prefill", fleet["prefill"][0],
           "--decode", fleet["decode"][0], "--replicas", str(replicas)]
    proc, line = _spawn(cmd, "router ready", env)
    pids = [int(x) for x in line.split("pids=")[1].split(",")] if "pids=" in line else [proc.pid]
    return proc, (f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"), pids


def _pin(cpus: set[int] | None) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []


def _cpu_split(router_cpus: str) -> tuple[set[int] | None, set[int] | None]:
    """(router CPUs, mocks' and client's CPUs). ``router_cpus``: "" = CPU 0 when there are 2+ CPUs, "none" = no
    pinning, else a list ("0" or "0,1"); the others get the remaining CPUs (all of them when none remain)."""
    cpus = sorted(os.sched_getaffinity(0))
    if router_cpus == "none" or (not router_cpus and len(cpus) < 2):
        return None, None
    chosen = {cpus[0]} if not router_cpus else {int(x) for x in router_cpus.split(",")}
    rest = set(cpus) - chosen
    return chosen, rest or set(cpus)


def _mock_cmd(
    ns: argparse.Namespace, prefill: int, decode: int, colocated: int, cpus: set[int] | None
) -> list[str]:
    return [*_pin(cpus), sys.executable, "-m", "common.testing.mock_fleet", "--prefill", str(prefill), "--decode", str(decode),
            "--colocated", str(colocated), "--service-time", str(ns.service_time),
            "--chunk-tokens", str(ns.chunk_tokens or ns.max_new_tokens), "--itl", str(ns.itl)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="per phase")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1], help="router replica counts to compare")
    ap.add_argument("--modes", nargs="+", choices=("grpc", "http"), default=["grpc"],
                    help="the router's client API measured: gRPC and/or the HTTP gateway (streamed completions)")
    ap.add_argument("--router-cpus", default="",
                    help='CPUs of the router processes ("0", "0,1"; "none": no pinning; default: CPU 0 on 2+ CPUs)')
    ap.add_argument("--service-time", type=float, default=0.02)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--stream", action="store_true", help="router requests stream text chunks")
    ap.add_argument(
        "--chunk-tokens", type=int, default=0, help="mock tokens per chunk (0: all in one message)"
    )
    ap.add_argument("--itl", type=float, default=0.0,
                    help="mock seconds between output chunks (0: all at once; a decode step's pace: 0.01)")
    ap.add_argument("--time-limit", type=float, default=120.0, help="per phase, seconds")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip the API floor (benchmarks.api_floor: the same client APIs with do-nothing handlers)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router_overhead.json"))
    ns = ap.parse_args()

    from common.testing.mock_fleet import make_model_dir
    from common.text.tokenizer import load_tokenizer
    from common.wire.security import CLUSTER_TOKEN_ENV, generate_cluster_token

    env = {**os.environ, "PDCLUSTER_LOG_LEVEL": "WARNING",
           "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "proto"), os.environ.get("PYTHONPATH", "")))}
    env.setdefault(CLUSTER_TOKEN_ENV, generate_cluster_token())  # the mocks prove it to the router
    procs: list[subprocess.Popen[str]] = []
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        model = make_model_dir(Path(tmp) / "mock-model")
        prompt_ids = load_tokenizer(model).encode(PROMPT)
        router_cpus, other_cpus = _cpu_split(ns.router_cpus)
        if other_cpus:
            os.sched_setaffinity(0, other_cpus)
        try:
            # one process for the P/D pair (they rendezvous in-process), one for the colocated mock
            pd_mocks, line = _spawn(_mock_cmd(ns, 1, 1, 0, other_cpus), "{", env)
            procs.append(pd_mocks)
            fleet = json.loads(line)
            colo, line = _spawn(_mock_cmd(ns, 0, 0, 1, other_cpus), "{", env)
            procs.append(colo)
            direct_addr = json.loads(line)["colocated"][0]
            floor = None
            if not ns.no_floor:
                floor = _start_floor(env, router_cpus)
                procs.append(floor[0])
            for replicas in ns.replicas:
                router, addr, pids = _start_router(model, fleet, replicas, env, router_cpus)
                try:
                    for mode in ns.modes:
                        for c in ns.concurrency:
                            res = asyncio.run(_run_pair(ns, direct_addr, addr, prompt_ids, pids, c, mode,
                                                        floor[1:] if floor is not None and replicas == 1 else None))
                            res["router_replicas"] = replicas
                            res["router_cpus"] = sorted(router_cpus) if router_cpus else "unpinned"
                            runs.append(res)
                            print(json.dumps({k: res.get(k) for k in SUMMARY_KEYS}), flush=True)
                finally:
                    _stop(router)
        finally:
            for p in reversed(procs):
                _stop(p)
    report = {
        "benchmark": "router_overhead",
        "config": {
            k: getattr(ns, k)
            for k in ("requests", "warmup", "concurrency", "replicas", "modes", "router_cpus", "service_time",
                      "max_new_tokens", "stream")
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "runs": runs,
        "load_average_at_end": os.getloadavg()[0],
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(runs))
    print(f"wrote {out}")
    return 0


SUMMARY_KEYS = ("mode", "router_replicas", "router_cpus", "concurrency", "added_p50_ms", "added_p99_ms", "throughput_ratio",
                "router_cpu_us_per_request", "floor_cpu_us_per_request", "loadavg")


def format_table(runs: list[dict[str, Any]]) -> str:
    head = ("| mode | replicas | router CPUs | c | direct req/s | router req/s | direct p50 | router p50 | added p50 ms | added p99 ms "
            "| router CPU us/req | floor CPU us/req | loadavg |")
    lines = [head, "|" + "---|" * 13]
    for r in runs:
        d, x = r["direct"], r["router_pd"]
        cpus = ",".join(map(str, r["router_cpus"])) if isinstance(r["router_cpus"], list) else r["router_cpus"]
        lines.append(f"| {r['mode']} | {r['router_replicas']} | {cpus} | {r['concurrency']} | {d['rps']} | {x['rps']} | {d['p50_ms']} | "
                     f"{x['p50_ms']} | {r['added_p50_ms']} | {r['added_p99_ms']} | "
                     f"{r['router_cpu_us_per_request']} | {r.get('floor_cpu_us_per_request', '')} | {r['loadavg']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
