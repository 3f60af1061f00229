"""The floor under the router's per-request CPU: the same two client APIs served by handlers that do nothing.

``Router.Generate`` on a bare ``grpc.aio`` server answers every call with one ready-made ``Complete`` (the size of the
router's, as the mock's tokens make it); ``POST /v1/completions`` on a bare aiohttp app streams one SSE chunk and
``data: [DONE]`` (the router's HTTP framing). ``router_overhead.py`` drives it with the same client, pinned to the
same CPUs as the router, and reports its CPU per request beside the router's: what remains above it is what the
router's own work (parsing, tokenizing, routing, two worker legs, detokenizing) costs.

    python -m benchmarks.api_floor --grpc-port P --http-port Q     # prints "floor ready" once both listen
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from aiohttp import web  # noqa: E402

from pdcluster.v1 import router_pb2, router_pb2_grpc  # noqa: E402

OUTPUT_IDS = list(range(100, 116))  # the mock's 16 tokens


class FloorRouter(router_pb2_grpc.RouterServicer):
    def __init__(self) -> None:
        self.final = router_pb2.RouterGenerateResponse(
            complete=router_pb2.Complete(request_id="floor", text=" tok" * len(OUTPUT_IDS), output_ids=OUTPUT_IDS,
                                         finish_reason="length")
        )

    async def Generate(self, request: router_pb2.RouterGenerateRequest, context: Any) -> Any:
        yield self.final


async def completions(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    chunk = {"id": "cmpl-floor", "object": "text_completion", "choices": [
        {"index": 0, "text": " tok" * len(OUTPUT_IDS), "finish_reason": "length"}]}
    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def serve(grpc_port: int, http_port: int) -> None:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(FloorRouter(), server)
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", http_port).start()
    print("floor ready", flush=True)
    await server.wait_for_termination()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpc-port", type=int, required=True)
    ap.add_argument("--http-port", type=int, required=True)
    ns = ap.parse_args()
    asyncio.run(serve(ns.grpc_port, ns.http_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
