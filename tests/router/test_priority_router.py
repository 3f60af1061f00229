"""Request priority through the router: the OpenAI extra field ``priority`` and the gRPC field reach both legs of a
PD pair (mock workers); a priority a protobuf int32 cannot carry is a clear 400 / INVALID_ARGUMENT; a priority over
its client's ceiling (``--max-client-priority``, a key's ``max_priority``; none for the admin token) is refused or
clamped (issue 54)."""

from __future__ import annotations

import dataclasses

import aiohttp
import grpc
import pytest

from common.env import ClientKey
from common.errors import InvalidRequestError
from pdcluster.v1 import common_pb2, router_pb2
from router.config import RouterConfig
from router.priority_policy import PriorityPolicy
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



def test_a_priority_ceiling_comes_from_the_key_else_the_flag_and_the_admin_token_has_none() -> None:
    cfg = RouterConfig(admin_token="the-admin-token", max_client_priority=0, api_keys=(
        ClientKey("ordinary"), ClientKey("batch", max_priority=-5), ClientKey("premium", max_priority=100)))
    policy = PriorityPolicy(cfg)
    bearer = {name: f"Bearer {name}" for name in ("ordinary", "batch", "premium", "the-admin-token")}
    assert policy.admit(None, bearer["ordinary"], False) is None  # no priority: the least urgent, never checked
    assert policy.admit(0, bearer["ordinary"], False) == 0 and policy.admit(-9, None, False) == -9
    with pytest.raises(InvalidRequestError, match=r"priority 1 .* send priority <= 0, or none \(the router's "
                                                  r"--max-client-priority\)"):
        policy.admit(1, bearer["ordinary"], False)
    with pytest.raises(InvalidRequestError, match=r"<= -5.*this API key's max_priority"):
        policy.admit(-4, bearer["batch"], False)
    assert policy.admit(100, bearer["premium"], False) == 100  # a key's own ceiling may be above the flag's
    assert policy.admit(2**31 - 1, bearer["the-admin-token"], False) == 2**31 - 1
    with pytest.raises(InvalidRequestError, match=">= 0 "):  # smaller values are the more urgent there
        policy.admit(-1, bearer["ordinary"], True)
    assert policy.admit(5, bearer["ordinary"], True) == 5
    clamp = PriorityPolicy(dataclasses.replace(cfg, client_priority_over="clamp"))
    assert clamp.admit(2**31 - 1, bearer["ordinary"], False) == 0 and clamp.admit(7, bearer["batch"], False) == -5
    assert clamp.admit(-7, bearer["batch"], True) == -5 and clamp.clamped == 3
    assert PriorityPolicy(RouterConfig()).admit(2**31 - 1, None, False) == 2**31 - 1  # no ceiling: as before


async def test_priorities_over_their_ceiling_are_refused_or_clamped_through_both_apis() -> None:
    keys = (ClientKey("ordinary-key"), ClientKey("premium-key", max_priority=50))
    kw = {"api_keys": keys, "admin_token": "the-admin-token", "max_client_priority": 0}
    async with fleet(prefill=1, decode=1, **kw) as f, aiohttp.ClientSession() as s:
        url = f.server.http_url + "/v1/completions"

        async def complete(key: str, priority: int) -> tuple[int, str]:
            body = {"model": "mock-model", "prompt": "hi", "max_tokens": 2, "priority": priority}
            async with s.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                return r.status, await r.text()

        status, text = await complete("ordinary-key", 2**31 - 1)
        assert status == 400 and "--max-client-priority" in text and "<= 0" in text
        assert (await complete("ordinary-key", 0))[0] == 200
        assert (await complete("premium-key", 50))[0] == 200 and (await complete("premium-key", 51))[0] == 400
        assert (await complete("the-admin-token", 2**31 - 1))[0] == 200  # the admin token is a client key too
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in f.stub().Generate(router_pb2.RouterGenerateRequest(
                    text="grpc", sampling_params=common_pb2.SamplingParams(max_new_tokens=2), priority=1),
                    metadata=(("authorization", "Bearer ordinary-key"),)):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-client-priority" in str(e.value.details())
        assert [r["priority"] for r in f.decode[0].received("decode")] == [0, 50, 2**31 - 1]
    async with fleet(prefill=1, decode=1, client_priority_over="clamp", **kw) as f, aiohttp.ClientSession() as s:
        body = {"model": "mock-model", "prompt": "hi", "max_tokens": 2, "priority": 2**31 - 1}
        async with s.post(f.server.http_url + "/v1/completions", json=body,
                          headers={"Authorization": "Bearer ordinary-key"}) as r:
            assert r.status == 200
        assert [r["priority"] for r in f.decode[0].received("decode")] == [0]  # served at its ceiling
