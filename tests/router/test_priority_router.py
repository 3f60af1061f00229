"""Request priority through the router: the OpenAI extra field ``priority`` and the gRPC field reach both legs of a
PD pair (mock workers); a priority a protobuf int32 cannot carry is a clear 400 / INVALID_ARGUMENT."""

from __future__ import annotations

import aiohttp
import pytest

from pdcluster.v1 import common_pb2, router_pb2
from router.testing import fleet


async def test_priority_reaches_both_legs_from_openai_and_grpc() -> None:
    async with fleet(prefill=1, decode=1) as f:
        client = f.openai()
        await client.completions.create(model="mock-model", prompt="hi", max_tokens=3, extra_body={"priority": 7})
        await client.chat.completions.create(model="mock-model", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=3, extra_body={"priority": -2})
        await client.completions.create(model="mock-model", prompt="no priority", max_tokens=3)
        stub = f.stub()
        async for _ in stub.Generate(router_pb2.RouterGenerateRequest(
                text="grpc", sampling_params=common_pb2.SamplingParams(max_new_tokens=3), priority=11)):
            pass
        for worker, kind in ((f.prefill[0], "prefill"), (f.decode[0], "decode")):
            assert [r["priority"] for r in worker.received(kind)] == [7, -2, None, 11], kind


@pytest.mark.parametrize("priority", [2**31, "high", True])
async def test_priority_out_of_range_is_a_clear_400(priority) -> None:
    async with fleet(prefill=1, decode=1) as f, aiohttp.ClientSession() as s:
        body = {"model": "mock-model", "prompt": "hi", "max_tokens": 2, "priority": priority}
        async with s.post(f.server.http_url + "/v1/completions", json=body) as r:
            assert r.status == 400
            assert "priority" in (await r.text())
        assert not f.prefill[0].received("prefill")

