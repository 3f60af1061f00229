"""The scale benchmark's parts (benchmarks/router_scale.py): a fleet of many mock workers packed in one process
behind the router, and the in-process routing-decision loop over a registry of load-reporting workers."""

from __future__ import annotations

import asyncio
import collections

from benchmarks.router_scale import measure_decisions
from pdcluster.v1 import common_pb2, router_pb2
from router.testing import eventually, fleet


async def test_packed_fleet_of_16_serves_concurrent_requests_across_workers() -> None:
    async with fleet(prefill=8, decode=8, common={"service_time": 0.01, "total_kv_pages": 512}) as f:
        registry = f.server.service.registry
        await eventually(lambda: len(registry.routable("prefill")) == 8 and len(registry.routable("decode")) == 8)
        stub = f.stub()
        sp = common_pb2.SamplingParams(max_new_tokens=4, temperature=0)

        async def one(i: int) -> str:
            req = router_pb2.RouterGenerateRequest(text=f"request {i} of the packed fleet", sampling_params=sp)
            out = [m async for m in stub.Generate(req)]
            assert out[-1].HasField("complete")
            return out[-1].complete.served_by

        served = await asyncio.gather(*(one(i) for i in range(48)))
        decodes = collections.Counter(s.split(" -> ")[1] for s in served)
        assert len(decodes) > 1, decodes  # load-aware picks spread 48 concurrent requests
        assert all(not w.active for w in f.workers)  # every mock request finished: KV back at its free count
        assert all(w.inflight == 0 for w in registry)


async def test_routing_decisions_cover_the_fleet_and_release_their_leases() -> None:
    out = await measure_decisions(8, 600, window=64, kv_pages=512, prefill_policy="cache_aware",
                                  decode_policy="power_of_two")
    assert out["decisions"] == 600 and out["decisions_per_s"] > 0
    assert out["decode_workers_used"] == 4
    assert out["inflight_after"] == 0
