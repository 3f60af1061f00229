"""Overload without collapse: admission counts request slots held outside the running batch; bounded queues."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput
from common.engine.sampling.params import SamplingParams
from common.engine.scheduler import Scheduler
from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.testing import eventually, fleet
from tests.model_fixtures import make_tiny_model


@pytest.fixture(scope="module")
def llama() -> Path:
    return make_tiny_model("llama")


def test_admission_counts_request_slots_held_outside_the_running_batch(llama) -> None:
    args = ServerArgs(max_running_requests=4, max_total_tokens=1024, page_size=4, chunked_prefill_size=64)
    sched = Scheduler(args, str(llama), None, lambda outs: None)
    pool = sched.req_to_token_pool
    total = pool.available_size()
    assert total == args.max_running_requests + 1
    held = pool.alloc(3)  # slots an inflight (prefill) or transfer (decode) queue still holds
    assert held is not None
    for i in range(4):
        sched.process_input_requests([GenerateReqInput(
            rid=f"r{i}", input_ids=[1 + i, 2, 3, 4, 5], sampling_params=SamplingParams(max_new_tokens=1),
        )])
    batch = sched.prefill.next_batch(sched.decode.running_batch)  # raised "out of request slots" before slots were counted
    assert batch is not None and len(batch.reqs) == 2
    assert pool.available_size() == 0 and len(sched.prefill.waiting_queue) == 2
    assert sched.decode.running_batch.batch_is_full
    assert sched.prefill.next_batch(sched.decode.running_batch) is None  # the queue waits; nothing raises
    for req in batch.reqs:
        req.output_ids.append(7)
        req.abort("test")
        sched.finish_req(req)
    pool.free(held)
    batch = sched.prefill.next_batch(sched.decode.running_batch)
    assert batch is not None and len(batch.reqs) == 2 and not sched.prefill.waiting_queue
    for req in batch.reqs:
        req.output_ids.append(7)
        req.abort("test")
        sched.finish_req(req)
    assert pool.available_size() == total
    sched.tree_cache.evict(args.max_total_tokens)
    assert sched.allocator.available_size() == sched.max_total_num_tokens


def gen(rid: str, n: int = 3) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        request_id=rid, text="Hello world", sampling_params=common_pb2.SamplingParams(max_new_tokens=n)
    )


async def test_router_tries_another_node_when_one_is_full_without_opening_its_circuit() -> None:
    full = {"fail_prefill": -1, "fail_code": grpc.StatusCode.RESOURCE_EXHAUSTED}
    async with fleet(prefill=[full, {}], decode=1, prefill_policy="round_robin", cb_failure_threshold=1) as f:
        stub = f.stub()
        for i in range(3):
            msgs = [m async for m in stub.Generate(gen(f"r{i}"))]
            assert msgs[-1].complete.usage.completion_tokens == 3
            assert msgs[-1].complete.served_by.startswith(f.name(f.prefill[1]))
        assert f.prefill[0].received("prefill")  # it was tried ...
        worker = f.server.service.registry.workers[f.prefill[0].address]
        assert worker.breaker.allows()  # ... and being full is not a fault: its circuit stays closed


async def test_every_node_full_is_429_with_retry_after() -> None:
    full = {"fail_prefill": -1, "fail_code": grpc.StatusCode.RESOURCE_EXHAUSTED}
    async with fleet(prefill=[full, full], decode=1, max_retries=5) as f:
        async with aiohttp.ClientSession() as s:
            body = {"model": "mock-model", "prompt": "hi", "max_tokens": 2}
            async with s.post(f.server.http_url + "/v1/completions", json=body) as r:
                assert r.status == 429
                assert int(r.headers["Retry-After"]) >= 1
                assert "at its request limit" in (await r.json())["error"]["message"]
        assert len(f.prefill[0].received("prefill")) == len(f.prefill[1].received("prefill")) == 1  # no spinning
        decode_rids = [d["rid"] for d in f.decode[0].received("decode")]
        await eventually(lambda: all(rid in f.decode[0].aborts for rid in decode_rids))  # both legs let go
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in f.stub().Generate(gen("g1")):
                pass
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(e.value.trailing_metadata() or ())["retry-after-ms"] == "1000"
        assert all(w.breaker.allows() for w in f.server.service.registry)


async def test_router_inflight_limit_answers_429() -> None:
    async with fleet(prefill=1, decode=1, common={"itl": 0.05}, max_inflight_requests=2) as f:
        stub = f.stub()
        running = [asyncio.ensure_future(_collect(stub, gen(f"slow{i}", n=20))) for i in range(2)]
        await eventually(lambda: len(f.server.service.core.active) == 2)
        async with aiohttp.ClientSession() as s:
            body = {"model": "mock-model", "prompt": "hi", "max_tokens": 2}
            async with s.post(f.server.http_url + "/v1/completions", json=body) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
                assert "--max-inflight-requests" in (await r.json())["error"]["message"]
        for fut in running:
            assert (await fut)[-1].complete.usage.completion_tokens == 20
        assert (await _collect(stub, gen("after")))[-1].complete.usage.completion_tokens == 3


async def _collect(stub: router_pb2_grpc.RouterStub, req: router_pb2.RouterGenerateRequest) -> list[Any]:
    return [m async for m in stub.Generate(req)]


async def test_router_skips_a_decode_node_whose_admission_budget_cannot_take_the_request() -> None:
    # Plenty of free pages on both, but the first node's own rule (reserved headroom per active request) admits
    # nothing now: it reports admissible_tokens 0 through GetLoad, and the router sends everything to the other.
    async with fleet(prefill=1, decode=[{"admissible_tokens": 0}, {"admissible_tokens": 100_000}],
                     decode_policy="round_robin") as f:
        full, roomy = f.decode
        await eventually(lambda: all(
            s.report is not None and s.report.HasField("admissible_tokens")
            for w in f.server.service.registry if w.role == "decode" for s in w.ranks))
        stub = f.stub()
        for i in range(6):
            msgs = await _collect(stub, gen(f"adm{i}"))
            assert msgs[-1].complete.served_by.endswith(f.name(roomy))
        assert not full.received("decode") and len(roomy.received("decode")) == 6
