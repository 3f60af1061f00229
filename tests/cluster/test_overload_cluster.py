"""Bursts of 400 and 2,000 concurrent requests far over the cluster's limits on real nodes (1 prefill + 2 decode,
tcp) through an in-process router: every request ends 200 or 429, no node dies, every pool comes back, and the
cluster serves afterwards."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator

import aiohttp
import pytest

from router.config import RouterConfig, WorkerSpec
from router.server import RouterServer
from tests.model_fixtures import make_tiny_model
from tests.node_helpers import Node, start_node, wait_all

pytestmark = pytest.mark.slow

# Small limits so the burst hits every one of them on 2 cores: node queues (RESOURCE_EXHAUSTED, tried on the
# other decode node first), request slots held by the prefill inflight queue, and the router's in-flight bound.
NODE_FLAGS = ["--max-running-requests", "4", "--max-queued-requests", "12", "--chunked-prefill-size", "64"]


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[Node]]:
    model = make_tiny_model("llama")
    started = wait_all([start_node(mode, model, extra=NODE_FLAGS, wait=False) for mode in ("prefill", "decode", "decode")])
    try:
        yield started
    finally:
        for n in started:
            n.stop()


@pytest.mark.parametrize("burst", [400, 2000])
async def test_burst_ends_200_or_429_and_the_cluster_keeps_serving(nodes, burst: int) -> None:
    p, d1, d2 = nodes
    cfg = RouterConfig(
        model_path=str(make_tiny_model("llama")),
        grpc_port=0,
        http_port=0,
        workers=(
            WorkerSpec(p.addr, "prefill", p.bootstrap_port),
            WorkerSpec(d1.addr, "decode"),
            WorkerSpec(d2.addr, "decode"),
        ),
        max_inflight_requests=150,
        health_interval_s=0.2,
        load_interval_s=0.1,
        request_timeout_s=120.0,
    )
    server = RouterServer(cfg)
    await server.start()
    try:
        url = server.http_url + "/v1/completions"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

            async def one(i: int) -> tuple[int, str | None]:
                body = {"model": server.service.model_name, "prompt": f"burst {i} hello", "max_tokens": 4, "temperature": 0}
                async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=180)) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After")

            results = await asyncio.gather(*(one(i) for i in range(burst)))
            statuses = collections.Counter(status for status, _ in results)
            assert set(statuses) <= {200, 429}, statuses
            assert statuses[200] > 0 and statuses[429] > 0, statuses  # the limits were reached, and work was done
            assert all(hint is not None and int(hint) >= 1 for status, hint in results if status == 429)
            for n in nodes:
                assert n.proc.poll() is None, f"{n.mode} node died:\n{n.log()}"
            for n in nodes:
                await asyncio.to_thread(n.wait_pools_free, 60.0)
            # Still serving: a few sequential requests all succeed.
            for i in range(4):
                status, _ = await one(10_000 + i)
                assert status == 200
        for n in nodes:
            assert "out of request slots" not in n.log()
    finally:
        await server.stop()
