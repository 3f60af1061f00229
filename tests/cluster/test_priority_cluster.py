"""Priorities through the router on real nodes: a PD pair started with --enable-priority-scheduling serves
prioritized requests (OpenAI extra field and gRPC) with the tokens a colocated node produces; a node without priority
scheduling refuses a prioritized request with a clear 400 / INVALID_ARGUMENT, through the router, its own gRPC
Worker API and its SGLang ``/generate``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import aiohttp
import grpc
import pytest

from common.ports import pick_free_port as free_port
from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from router.config import RouterConfig, WorkerSpec
from router.server import RouterServer
from tests.model_fixtures import make_tiny_model
from tests.node_helpers import Node, start_node, wait_all

pytestmark = pytest.mark.slow

PRIORITY = ["--enable-priority-scheduling", "--schedule-policy", "lpm", "--max-running-requests", "2"]
SGLANG_PORT = free_port()


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Node]]:
    model = make_tiny_model("llama")
    started = wait_all([
        start_node("prefill", model, extra=PRIORITY, wait=False),
        start_node("decode", model, extra=PRIORITY, wait=False),
        start_node("null", model, extra=["--sglang-http-port", str(SGLANG_PORT)], wait=False),
    ])
    try:
        yield dict(zip(("prefill", "decode", "plain"), started, strict=True))
    finally:
        for n in started:
            n.stop()


@pytest.fixture
async def routers(nodes) -> AsyncIterator[tuple[RouterServer, RouterServer]]:
    p, d, plain = nodes["prefill"], nodes["decode"], nodes["plain"]
    common = {"model_path": str(make_tiny_model("llama")), "grpc_port": 0, "http_port": 0,
              "health_interval_s": 0.2, "load_interval_s": 0.1, "request_timeout_s": 120.0}
    pd = RouterServer(RouterConfig(workers=(WorkerSpec(p.addr, "prefill", p.bootstrap_port),
                                            WorkerSpec(d.addr, "decode")), **common))
    colocated = RouterServer(RouterConfig(workers=(WorkerSpec(plain.addr, "colocated"),), **common))
    await pd.start()
    await colocated.start()
    try:
        yield pd, colocated
    finally:
        await pd.stop(0)
        await colocated.stop(0)


async def complete(s: aiohttp.ClientSession, server: RouterServer, prompt: str, **extra: object) -> tuple[int, dict]:
    body = {"model": server.service.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, **extra}
    async with s.post(server.http_url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        return r.status, await r.json()


async def test_pd_with_priorities_matches_colocated(nodes, routers) -> None:
    pd, colocated = routers
    prompts = [f"request {i} about the sea and the sky" for i in range(6)]
    async with aiohttp.ClientSession() as s:
        reference = await asyncio.gather(*(complete(s, colocated, p) for p in prompts))
        served = await asyncio.gather(*(complete(s, pd, p, priority=i % 3) for i, p in enumerate(prompts)))
    for (status_ref, ref), (status, out) in zip(reference, served, strict=True):
        assert status_ref == 200 and status == 200, out
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    stub = router_pb2_grpc.RouterStub(grpc.aio.insecure_channel(pd.grpc_address))
    text = ""
    async for resp in stub.Generate(router_pb2.RouterGenerateRequest(
            text=prompts[0], priority=9,
            sampling_params=common_pb2.SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))):
        text += resp.chunk.text if resp.HasField("chunk") else resp.complete.text
    assert text == reference[0][1]["choices"][0]["text"]
    for n in (nodes["prefill"], nodes["decode"]):
        await asyncio.to_thread(n.wait_pools_free, 60.0)


async def test_priority_on_a_node_without_priority_scheduling_is_a_clear_400(nodes, routers) -> None:
    _, colocated = routers
    async with aiohttp.ClientSession() as s:
        status, body = await complete(s, colocated, "hello", priority=3)
        assert status == 400, body
        assert "--enable-priority-scheduling" in str(body)
        gen = {"text": "hello", "priority": 3, "sampling_params": {"max_new_tokens": 2}}
        async with s.post(f"http://127.0.0.1:{SGLANG_PORT}/generate", json=gen) as r:
            assert r.status == 400
            assert "--enable-priority-scheduling" in await r.text()
    sp = common_pb2.SamplingParams(max_new_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        list(nodes["plain"].stub.Generate(worker_pb2.GenerateRequest(rid="p", input_ids=[5, 6, 7], sampling_params=sp,
                                                                     priority=1), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--enable-priority-scheduling" in e.value.details()
