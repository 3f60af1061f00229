"""A node process stalled for 20 s (SIGSTOP, then SIGCONT) on a real 1 prefill + 1 decode cluster (tcp) behind an
in-process router: requests caught in the stall fail with a clear status, new requests succeed within 10 s."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest

from router.config import RouterConfig, WorkerSpec
from router.server import RouterServer
from tests.model_fixtures import make_tiny_model
from tests.node_helpers import Node, start_node, wait_all

pytestmark = pytest.mark.slow

STALL_S = 20.0
RECOVER_S = 10.0


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[Node]]:
    model = make_tiny_model("llama")
    started = wait_all([start_node(mode, model, wait=False) for mode in ("prefill", "decode")])
    try:
        yield started
    finally:
        for n in started:
            n.stop()


@pytest.mark.parametrize("stalled", ["prefill", "decode"])
async def test_stalled_node_serves_again_within_seconds_of_sigcont(nodes, stalled) -> None:
    p, d = nodes
    victim = p if stalled == "prefill" else d
    cfg = RouterConfig(
        model_path=str(make_tiny_model("llama")),
        grpc_port=0,
        http_port=0,
        workers=(WorkerSpec(p.addr, "prefill", p.bootstrap_port), WorkerSpec(d.addr, "decode")),
        health_interval_s=0.5,
        load_interval_s=0.2,
        request_timeout_s=8.0,
    )
    server = RouterServer(cfg)
    await server.start()
    url = server.http_url + "/v1/completions"
    try:
        async with aiohttp.ClientSession() as s:

            async def one(i: int, timeout: float = 30) -> int:
                body = {"model": server.service.model_name, "prompt": f"stall {i}", "max_tokens": 4,
                        "temperature": 0}
                try:
                    async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                        await r.read()
                        return r.status
                except TimeoutError:
                    return 0

            assert await one(0) == 200
            os.kill(victim.proc.pid, signal.SIGSTOP)
            try:
                caught = asyncio.ensure_future(one(1))  # in flight during the stall
                await asyncio.sleep(STALL_S)
            finally:
                os.kill(victim.proc.pid, signal.SIGCONT)
            resumed = time.monotonic()
            assert await caught in (200, 503, 504)  # a clear status, never a hang
            i = 2
            while True:
                status = await one(i, timeout=RECOVER_S)
                if status == 200:
                    break
                assert time.monotonic() - resumed < RECOVER_S, f"no success {RECOVER_S} s after SIGCONT ({status})"
                i += 1
                await asyncio.sleep(0.2)
            assert time.monotonic() - resumed < RECOVER_S
            for k in range(3):  # and it stays up
                assert await one(100 + k) == 200
        for n in nodes:
            assert n.proc.poll() is None
            await asyncio.to_thread(n.wait_pools_free, 30.0)
    finally:
        await server.stop()
