"""Attacks on the router's admin surface: without the admin bearer token nobody changes or reads the fleet."""

from __future__ import annotations

import os

import aiohttp
import grpc
import pytest

from pdcluster.v1 import common_pb2, router_pb2
from router.guards.admin import bearer_metadata
from router.testing import fleet


async def test_rogue_register_and_deregister_are_refused_and_change_nothing() -> None:
    async with fleet(prefill=1, decode=1) as f:
        stub = f.stub()
        for metadata in ((), bearer_metadata("a-guessed-admin-token-value")):
            for call, request in (
                (stub.DeregisterWorker, router_pb2.DeregisterWorkerRequest(address=f.decode[0].address)),
                (stub.RegisterWorker, router_pb2.RegisterWorkerRequest(address="127.0.0.1:1",
                                                                       role=router_pb2.WORKER_ROLE_DECODE)),
                (stub.ListWorkers, router_pb2.ListWorkersRequest()),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(request, metadata=metadata)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The fleet is intact: requests still go through, and the admin sees exactly the two real workers.
        msgs = [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(
            text="x", sampling_params=common_pb2.SamplingParams(max_new_tokens=2)))]
        assert msgs[-1].complete.usage.completion_tokens == 2
        admin = bearer_metadata(os.environ["PDCLUSTER_CLUSTER_TOKEN"])
        listed = await stub.ListWorkers(router_pb2.ListWorkersRequest(), metadata=admin)
        assert sorted(w.address for w in listed.workers) == sorted(w.address for w in f.workers)


async def test_internal_http_views_need_the_admin_token() -> None:
    async with fleet(prefill=1, decode=1) as f, aiohttp.ClientSession() as http:
        for path in ("/metrics", "/v1/workers", "/v1/requests/some-id/timing"):
            async with http.get(f.server.http_url + path) as r:
                assert r.status == 401, path
                assert "127.0.0.1" not in await r.text()
            async with http.get(f.server.http_url + path, headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401, path
        async with http.get(f.server.http_url + "/v1/workers",
                            headers={"Authorization": f"Bearer {os.environ['PDCLUSTER_CLUSTER_TOKEN']}"}) as r:
            assert r.status == 200 and len((await r.json())["workers"]) == 2
        async with http.get(f.server.http_url + "/v1/models") as r:
            assert r.status == 200  # the client surface stays open


@pytest.mark.parametrize("rid", ["evil\r\nSet-Cookie: a=b", "x" * 1_000_000, "sp ace"])
async def test_bad_request_ids_get_a_clean_400_before_any_generation(rid: str) -> None:
    async with fleet(prefill=1, decode=1) as f, aiohttp.ClientSession() as http:
        body = {"model": "mock-model", "prompt": "hi", "max_tokens": 2, "request_id": rid}
        async with http.post(f.server.http_url + "/v1/completions", json=body) as r:
            assert r.status == 400
            assert "request_id" in (await r.json())["error"]["message"]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in f.stub().Generate(router_pb2.RouterGenerateRequest(text="hi", request_id=rid)):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert all(not w.records for w in f.workers)  # nothing reached a node


@pytest.mark.parametrize("body", [
    b'{"prompt": "\xff\xfe", "max_tokens": 2}',
    b'{"prompt": "hi", "max_tokens": 2, "metadata": ' + b'{"a":' * 20000 + b"1" + b"}" * 20000 + b"}",
    b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e308}',
])
async def test_malformed_bodies_get_a_clean_400(body: bytes) -> None:
    async with fleet(prefill=1, decode=1) as f, aiohttp.ClientSession() as http:
        async with http.post(f.server.http_url + "/v1/completions", data=body,
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            assert "127.0.0.1" not in await r.text()
        assert all(not w.records for w in f.workers)


async def test_garbage_protobuf_is_invalid_argument() -> None:
    async with fleet(prefill=1, decode=1) as f:
        channel = grpc.aio.insecure_channel(f.server.grpc_address)
        generate = channel.unary_stream("/pdcluster.v1.Router/Generate", request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in generate(b"\xff\xff\xff\xff not protobuf"):
                pass
        await channel.close()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
