"""The floor under a streamed gRPC ``Router.Generate``: a bare ``grpc.aio`` server (uvloop, as the router) whose
handler writes ``--messages`` one-token chunks ``--itl`` seconds apart and then one ``Complete``; the server's CPU
per call from /proc, pinned to CPU 0 with the closed-loop client (c=32) on CPU 1. What a one-message-per-token gRPC
stream costs before the router does any work (``pages/sglang_router_compare.md``, the gRPC path vs the HTTP path).

    .venv/bin/python -m benchmarks.grpc_stream_floor --messages 0 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))

import grpc  # noqa: E402

from pdcluster.v1 import router_pb2, router_pb2_grpc  # noqa: E402


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class Streamer(router_pb2_grpc.RouterServicer):
    def __init__(self, messages: int, itl: float) -> None:
        self.messages, self.itl = messages, itl
        self.final = router_pb2.RouterGenerateResponse(complete=router_pb2.Complete(
            request_id="floor", text=" tok" * 16, output_ids=list(range(16)), finish_reason="length"))

    async def Generate(self, request: Any, context: Any) -> None:
        for i in range(self.messages):
            await asyncio.sleep(self.itl)
            m = router_pb2.RouterGenerateResponse()
            m.chunk.text = " tok"
            m.chunk.token_ids.append(i)
            await context.write(m)
        await context.write(self.final)


async def _serve(port: int, messages: int, itl: float) -> None:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(Streamer(messages, itl), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("floor ready", flush=True)
    await server.wait_for_termination()


async def _drive(port: int, requests: int, concurrency: int) -> None:
    chs = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
           for _ in range(max(1, concurrency // 8))]
    stubs = [router_pb2_grpc.RouterStub(c) for c in chs]
    issued = 0

    async def client() -> None:
        nonlocal issued
        while issued < requests:
            issued += 1
            async for _ in stubs[issued % len(stubs)].Generate(router_pb2.RouterGenerateRequest(stream=True)):
                pass

    await asyncio.gather(*(client() for _ in range(concurrency)))
    for c in chs:
        await c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, nargs="+", default=[0, 16], help="chunks before the Complete")
    ap.add_argument("--itl", type=float, default=0.005)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--serve", nargs=3, metavar=("PORT", "MESSAGES", "ITL"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.serve:
        import uvloop

        uvloop.install()
        asyncio.run(_serve(int(ns.serve[0]), int(ns.serve[1]), float(ns.serve[2])))
        return 0
    from common.ports import pick_free_port

    pin = len(os.sched_getaffinity(0)) >= 2
    for messages in ns.messages:
        port = pick_free_port()
        cmd = [*(["taskset", "-c", "0"] if pin else []), sys.executable, "-m", "benchmarks.grpc_stream_floor",
               "--serve", str(port), str(messages), str(ns.itl)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            assert proc.stdout is not None and "floor ready" in proc.stdout.readline()
            if pin:
                os.sched_setaffinity(0, {1})
            asyncio.run(_drive(port, ns.requests // 10, ns.concurrency))  # warm-up
            cpu0, t0 = _cpu_s(proc.pid), time.perf_counter()
            asyncio.run(_drive(port, ns.requests, ns.concurrency))
            print(json.dumps({"messages": messages + 1, "itl": ns.itl, "wall_s": round(time.perf_counter() - t0, 2),
                              "server_cpu_us_per_call": round((_cpu_s(proc.pid) - cpu0) / ns.requests * 1e6, 1),
                              "loadavg": os.getloadavg()[0]}), flush=True)
        finally:
            proc.terminate()
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
