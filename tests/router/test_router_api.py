"""Router client APIs against mock workers: OpenAI HTTP (official client), gRPC Router, membership, observability."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import grpc
import pytest

from common.testing.mock_fleet import shared_model_dir
from common.testing.mock_requests import fake_tokens
from common.text.tokenizer import load_tokenizer
from pdcluster.v1 import common_pb2, router_pb2
from router.admin import bearer_metadata
from router.testing import eventually, fleet

ADMIN = bearer_metadata(os.environ["PDCLUSTER_CLUSTER_TOKEN"])  # the router's admin token defaults to it
ADMIN_HEADERS = dict(ADMIN)
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(shared_model_dir())


def expected_text(prompt_ids: list[int], n: int) -> str:
    return tokenizer().decode(fake_tokens(prompt_ids, n, 1536), skip_special_tokens=True)


async def test_openai_completions_and_chat_stream_and_not() -> None:
    async with fleet(prefill=2, decode=2) as f:
        client = f.openai()
        tok = tokenizer()
        ids = tok.encode("Hello world")

        r = await client.completions.create(model="mock-model", prompt="Hello world", max_tokens=7)
        assert r.choices[0].text == expected_text(ids, 7)
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 7)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        ext = r.model_extra["pdcluster"]
        assert "->" in ext["served_by"] and ext["timing"]["e2e"] >= ext["timing"]["ttft"] > 0

        stream = await client.completions.create(
            model="mock-model",
            prompt="Hello world",
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        assert text == expected_text(ids, 7)
        assert usage is not None and usage.completion_tokens == 7 and usage.prompt_tokens == len(ids)

        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        chat_ids = tok.encode(
            tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        c = await client.chat.completions.create(model="mock-model", messages=msgs, max_tokens=5)
        assert c.choices[0].message.role == "assistant"
        assert c.choices[0].message.content == expected_text(chat_ids, 5)
        assert c.usage.prompt_tokens == len(chat_ids) and c.usage.completion_tokens == 5

        stream = await client.chat.completions.create(
            model="mock-model",
            messages=msgs,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, reasons = "", None, []
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reasons.append(chunk.choices[0].finish_reason)
            if chunk.usage:
                usage = chunk.usage
        assert text == expected_text(chat_ids, 5)
        assert reasons[-1] == "length" and usage is not None and usage.completion_tokens == 5


async def test_cached_tokens_come_from_the_prefill_node() -> None:
    async with fleet(prefill=2, decode=1, prefill_policy="cache_aware") as f:
        client = f.openai()
        first = await client.completions.create(model="mock-model", prompt=LONG_PROMPT, max_tokens=2)
        second = await client.completions.create(
            model="mock-model", prompt=LONG_PROMPT + "More.", max_tokens=2
        )
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens
        # cache_aware sent the shared prefix to the same prefill node.
        assert [len(w.received("prefill")) for w in f.prefill] in ([2, 0], [0, 2])


async def test_grpc_generate_stream_and_unary() -> None:
    async with fleet(prefill=1, decode=1) as f:
        stub = f.stub()
        ids = tokenizer().encode("Hello world")
        req = router_pb2.RouterGenerateRequest(
            request_id="g-1",
            text="Hello world",
            stream=True,
            sampling_params=common_pb2.SamplingParams(max_new_tokens=6),
        )
        msgs = [m async for m in stub.Generate(req)]
        chunks = [m.chunk for m in msgs if m.HasField("chunk")]
        done = msgs[-1].complete
        assert [t for c in chunks for t in c.token_ids] == fake_tokens(ids, 6, 1536) == list(done.output_ids)
        assert "".join(c.text for c in chunks) == done.text == expected_text(ids, 6)
        assert done.request_id == "g-1" and done.finish_reason == "length"
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), 6)
        assert done.timing.e2e > 0 and done.served_by == "prefill-0 -> decode-0"
        assert done.served_by == f"{f.name(f.prefill[0])} -> {f.name(f.decode[0])}"

        unary = router_pb2.RouterGenerateRequest(
            input_ids=router_pb2.TokenIds(ids=[10, 11, 12]),
            sampling_params=common_pb2.SamplingParams(max_new_tokens=3),
        )
        msgs = [m async for m in stub.Generate(unary)]
        assert len(msgs) == 1 and list(msgs[0].complete.output_ids) == fake_tokens([10, 11, 12], 3, 1536)

        chat = router_pb2.RouterGenerateRequest(
            messages=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="hi")]),
            sampling_params=common_pb2.SamplingParams(max_new_tokens=2, stop_token_ids=[]),
        )
        msgs = [m async for m in stub.Generate(chat)]
        assert msgs[-1].complete.usage.completion_tokens == 2

        models = await stub.ListModels(router_pb2.ListModelsRequest())
        assert list(models.models) == ["mock-model"]


async def test_the_router_picks_dp_ranks_and_sends_the_bootstrap_address() -> None:
    async with fleet(prefill=1, decode=1, common={"dp_size": 2}) as f:
        client = f.openai()
        for i in range(8):
            await client.completions.create(model="mock-model", prompt=f"prompt number {i}", max_tokens=1)
        p, d = f.prefill[0], f.decode[0]
        assert {r["rank"] for r in p.received("prefill")} == {0, 1}
        assert {r["rank"] for r in d.received("decode")} == {0, 1}
        for rec in d.received("decode"):
            assert rec["bootstrap_addr"] == f"127.0.0.1:{p.bootstrap_port}"
        rooms = [r["room"] for r in p.received("prefill")]
        assert len(set(rooms)) == 8 and all(0 < r < 2**63 for r in rooms)


async def test_colocated_fleet() -> None:
    async with fleet(prefill=0, decode=0, colocated=2, prefill_policy="round_robin") as f:
        client = f.openai()
        ids = tokenizer().encode("Hello world")
        for _ in range(2):
            r = await client.completions.create(model="mock-model", prompt="Hello world", max_tokens=4)
            assert r.choices[0].text == expected_text(ids, 4)
        assert [len(w.received("generate")) for w in f.colocated] == [1, 1]
        assert [f.name(w) for w in f.colocated] == ["colocated-0", "colocated-1"]
        assert r.model_extra["pdcluster"]["served_by"] in ["colocated-0", "colocated-1"]


async def test_membership_and_observability_endpoints() -> None:
    async with fleet(prefill=1, decode=1) as f:
        stub = f.stub()
        listed = await stub.ListWorkers(router_pb2.ListWorkersRequest(), metadata=ADMIN)
        roles = sorted((w.role, w.healthy, w.circuit_state) for w in listed.workers)
        assert roles == [
            (router_pb2.WORKER_ROLE_PREFILL, True, "closed"),
            (router_pb2.WORKER_ROLE_DECODE, True, "closed"),
        ]
        prefill_status = next(w for w in listed.workers if w.role == router_pb2.WORKER_ROLE_PREFILL)
        assert prefill_status.bootstrap_port == f.prefill[0].bootstrap_port
        assert all(w.error == "" for w in listed.workers)  # routable workers carry no error

        # Deregister the only decode worker: requests fail with UNAVAILABLE naming the reason.
        found = await stub.DeregisterWorker(router_pb2.DeregisterWorkerRequest(address=f.decode[0].address), metadata=ADMIN)
        assert found.found
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(router_pb2.RouterGenerateRequest(text="x")):
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "decode" in e.value.details()
        await stub.RegisterWorker(
            router_pb2.RegisterWorkerRequest(address=f.decode[0].address, role=router_pb2.WORKER_ROLE_DECODE),
            metadata=ADMIN,
        )
        msgs = [
            m
            async for m in stub.Generate(
                router_pb2.RouterGenerateRequest(
                    text="x",
                    request_id="after-register",
                    sampling_params=common_pb2.SamplingParams(max_new_tokens=2),
                )
            )
        ]
        assert msgs[-1].complete.usage.completion_tokens == 2
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.RegisterWorker(
                router_pb2.RegisterWorkerRequest(
                    address=f.decode[0].address, role=router_pb2.WORKER_ROLE_PREFILL
                ),
                metadata=ADMIN,
            )
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already registered" in e.value.details()
        )

        async with aiohttp.ClientSession(headers=ADMIN_HEADERS) as http:
            async with http.get(f.server.http_url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "mock-model"
            async with http.get(f.server.http_url + "/health") as r:
                assert r.status == 200
            async with http.get(f.server.http_url + "/v1/requests/after-register/timing") as r:
                t = (await r.json())["timing"]
                assert t["attempts"] == 1 and t["e2e"] > 0 and "->" in t["served_by"]
            async with http.get(f.server.http_url + "/v1/requests/nope/timing") as r:
                assert r.status == 404
            async with http.get(f.server.http_url + "/metrics") as r:
                text = await r.text()
        for name in (
            "pdcluster_router_ttft_seconds_bucket",
            "pdcluster_router_itl_seconds_bucket",
            "pdcluster_router_e2e_seconds_bucket",
            "pdcluster_router_inflight_requests",
            "pdcluster_router_retries_total",
            "pdcluster_router_aborts_total",
        ):
            assert name in text
        assert 'pdcluster_router_requests_total{api="grpc",outcome="success"} 1.0' in text
        assert 'pdcluster_router_requests_total{api="grpc",outcome="unavailable"} 1.0' in text
        for w, role in ((f.prefill[0], "prefill"), (f.decode[0], "decode")):
            assert f'pdcluster_router_dispatches_total{{role="{role}",worker="{w.address}"}} 1.0' in text


async def test_health_checks_take_an_unhealthy_worker_out_and_back() -> None:
    async with fleet(prefill=1, decode=2, decode_policy="round_robin") as f:
        client = f.openai()
        await f.decode[0].set_serving(False)
        w0 = f.server.service.registry.workers[f.decode[0].address]
        await eventually(lambda: not w0.healthy)
        for _ in range(4):
            await client.completions.create(model="mock-model", prompt="hi", max_tokens=1)
        assert len(f.decode[0].received("decode")) == 0 and len(f.decode[1].received("decode")) == 4
        await f.decode[0].set_serving(True)
        await eventually(lambda: w0.healthy)
        for _ in range(4):
            await client.completions.create(model="mock-model", prompt="hi", max_tokens=1)
        assert len(f.decode[0].received("decode")) == 2


async def test_list_workers_says_why_a_worker_is_unusable() -> None:
    async with fleet(prefill=1, decode=2) as f:
        stub = f.stub()
        # A decode node registered as a prefill worker: the router refuses to route to it and says why.
        await stub.DeregisterWorker(router_pb2.DeregisterWorkerRequest(address=f.decode[1].address), metadata=ADMIN)
        await stub.RegisterWorker(
            router_pb2.RegisterWorkerRequest(address=f.decode[1].address, role=router_pb2.WORKER_ROLE_PREFILL),
            metadata=ADMIN,
        )

        async def error_of_misregistered() -> str:
            listed = await stub.ListWorkers(router_pb2.ListWorkersRequest(), metadata=ADMIN)
            return next((w.error for w in listed.workers if w.role == router_pb2.WORKER_ROLE_PREFILL
                         and w.address == f.decode[1].address), "")

        deadline = asyncio.get_running_loop().time() + 10
        while not await error_of_misregistered():
            assert asyncio.get_running_loop().time() < deadline, "no error reported for a wrong-mode worker"
            await asyncio.sleep(0.05)
        assert "mode" in await error_of_misregistered()
