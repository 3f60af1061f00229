"""Router fault handling against mock workers: retries, unavailability, cancellation, admission, deadlines."""

from __future__ import annotations

import asyncio
import time

import grpc
import openai
import pytest

from pdcluster.v1 import common_pb2, router_pb2
from router.testing import eventually, fleet


def gen(
    text: str = "Hello world", n: int = 4, rid: str = "", stream: bool = False
) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        request_id=rid, text=text, stream=stream, sampling_params=common_pb2.SamplingParams(max_new_tokens=n)
    )


async def test_prefill_failure_is_retried_on_another_prefill_worker() -> None:
    async with fleet(prefill=[{"fail_prefill": -1}, {}], decode=1, prefill_policy="round_robin") as f:
        bad, good = f.prefill
        stub = f.stub()
        msgs = [m async for m in stub.Generate(gen(rid="r1"))]
        done = msgs[-1].complete
        assert done.usage.completion_tokens == 4 and done.served_by.startswith(f.name(good))
        assert done.attempts == 2
        assert [r["rid"] for r in bad.received("prefill")] == ["r1"]
        assert [r["rid"] for r in good.received("prefill")] == ["r1#1"]
        # A new room for the retry. The first attempt's decode leg was cancelled as soon as its prefill failed: its
        # node ran it or, when the cancel caught up with the open on the Mux stream, never started it.
        first, retry = bad.received("prefill")[0]["room"], good.received("prefill")[0]["room"]
        assert first != retry
        rooms = [r["room"] for r in f.decode[0].received("decode")]
        assert rooms[-1] == retry and rooms[:-1] in ([], [first])
        # The failed attempt was aborted on both of its nodes.
        await eventually(lambda: "r1" in bad.aborts and "r1" in f.decode[0].aborts)
        metrics = f.server.service.metrics.render().decode()
        assert 'pdcluster_router_retries_total{leg="prefill"} 1.0' in metrics


async def test_decode_dying_before_the_first_token_is_retried() -> None:
    async with fleet(prefill=1, decode=[{"die_before_first_token": 1}, {}], decode_policy="round_robin") as f:
        client = f.openai()
        r = await client.completions.create(model="mock-model", prompt="hi", max_tokens=3, stream=False)
        assert r.usage.completion_tokens == 3 and r.model_extra["pdcluster"]["timing"]["attempts"] == 2


async def test_all_prefill_workers_down_is_a_clear_unavailable_within_the_deadline() -> None:
    async with fleet(prefill=2, decode=1) as f:
        for w in f.prefill:
            await w.stop()
        stub = f.stub()
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(gen(), timeout=5):
                pass
        assert time.monotonic() - t0 < 5
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "prefill" in e.value.details().lower() or "Prefill" in e.value.details()
        assert dict(e.value.trailing_metadata() or ())["retry-after-ms"] == "1000"  # back off, do not hammer

        client = f.openai()
        with pytest.raises(openai.APIStatusError) as http_err:
            await client.completions.create(model="mock-model", prompt="hi", max_tokens=2)
        assert http_err.value.status_code == 503
        # Health checks then take them out: the error says why, without trying them.
        await eventually(lambda: not any(w.healthy for w in f.server.service.registry if w.role == "prefill"))
        with pytest.raises(openai.APIStatusError) as http_err:
            await client.completions.create(model="mock-model", prompt="hi", max_tokens=2)
        assert http_err.value.status_code == 503 and "no routable prefill worker" in str(http_err.value)
        assert http_err.value.response.headers["Retry-After"] == "1"


async def test_client_cancel_mid_stream_aborts_both_legs() -> None:
    async with fleet(prefill=1, decode=1, common={"itl": 0.05}) as f:
        stub = f.stub()
        call = stub.Generate(gen(n=200, rid="cancel-me", stream=True))
        got = 0
        async for m in call:
            got += m.HasField("chunk")
            if got == 3:
                break
        call.cancel()
        p, d = f.prefill[0], f.decode[0]
        await eventually(lambda: "cancel-me" in p.aborts and "cancel-me" in d.aborts)
        await eventually(lambda: not d.active and f.server.service.pipeline.active == set())
        assert f.server.service.pipeline.planner.rooms.in_flight == set()


async def test_http_client_disconnect_aborts_both_legs() -> None:
    async with fleet(prefill=1, decode=1, common={"itl": 0.05}) as f:
        client = f.openai()
        stream = await client.completions.create(
            model="mock-model",
            prompt="hi",
            max_tokens=200,
            stream=True,
            extra_headers={"X-Request-ID": "http-cancel"},
        )
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                break
        await stream.close()
        p, d = f.prefill[0], f.decode[0]
        await eventually(lambda: "http-cancel" in p.aborts and "http-cancel" in d.aborts)
        await eventually(lambda: not d.active)


async def test_a_decode_worker_without_room_is_skipped() -> None:
    async with fleet(
        prefill=1, decode=[{"free_kv_pages": 1}, {"free_kv_pages": 4096}], decode_policy="round_robin"
    ) as f:
        client = f.openai()
        for _ in range(4):
            await client.completions.create(model="mock-model", prompt="a prompt " * 10, max_tokens=64)
        full, roomy = f.decode
        assert len(full.received("decode")) == 0 and len(roomy.received("decode")) == 4


async def test_failure_after_streaming_began_is_an_error_not_a_short_success() -> None:
    async with fleet(prefill=1, decode=[{"die_after_tokens": 2}], max_migrations=0) as f:
        stub = f.stub()
        chunks = 0
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for m in stub.Generate(gen(n=10, stream=True)):
                chunks += m.HasField("chunk")
                assert not m.HasField("complete")
        assert chunks >= 1 and e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "0 migration(s), the limit (--max-migrations)" in e.value.details()

        # Not streaming: the tokens produced are not lost to a retry from scratch; with no migration allowed the
        # request fails rather than returning a short success.
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(gen(n=10)):
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "--max-migrations" in e.value.details()


async def test_deadline_is_enforced_and_both_legs_aborted() -> None:
    async with fleet(prefill=[{"hang": True}], decode=1) as f:
        stub = f.stub()
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(gen(rid="slow"), timeout=0.5):
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 2
        await eventually(lambda: "slow" in f.prefill[0].aborts and "slow" in f.decode[0].aborts)


async def test_circuit_breaker_opens_on_repeated_failures() -> None:
    async with fleet(
        prefill=[{"fail_prefill": -1}, {}],
        decode=1,
        prefill_policy="round_robin",
        cb_failure_threshold=2,
        cb_open_s=60,
        health_interval_s=600,  # a passing health round would half-open it early (tested in test_router_units)
    ) as f:
        client = f.openai()
        for _ in range(6):
            await client.completions.create(model="mock-model", prompt="hi", max_tokens=1)
        bad = f.server.service.registry.workers[f.prefill[0].address]
        assert bad.breaker.state == "open"
        assert len(f.prefill[0].received("prefill")) == 2  # nothing routed there once open


async def test_an_open_circuit_never_blackholes_the_only_healthy_worker_of_a_role() -> None:
    """A glitch opens the only prefill worker's circuit; its health checks pass, so requests still reach it (and
    its first success closes the circuit) instead of 503 for the whole cool-down."""
    async with fleet(prefill=[{"fail_prefill": 2}], decode=1, cb_failure_threshold=2, cb_open_s=600,
                     max_retries=0, health_interval_s=600) as f:  # no health round half-opens it meanwhile
        client = f.openai()
        for _ in range(2):
            with pytest.raises(openai.APIStatusError):
                await client.completions.create(model="mock-model", prompt="hi", max_tokens=1)
        only = f.server.service.registry.workers[f.prefill[0].address]
        assert only.breaker.state == "open"
        r = await client.completions.create(model="mock-model", prompt="hi", max_tokens=1)
        assert r.usage.completion_tokens == 1
        assert only.breaker.state == "closed"
        assert len(f.prefill[0].received("prefill")) == 3


async def test_a_decode_failure_blamed_on_its_kv_peer_counts_against_the_prefill_worker() -> None:
    async with fleet(prefill=1, decode=[{"kv_peer_fault": 1}], max_retries=0, cb_open_s=600) as f:
        with pytest.raises(openai.APIStatusError):
            await f.openai().completions.create(model="mock-model", prompt="hi", max_tokens=2)
        workers = f.server.service.registry.workers
        assert workers[f.prefill[0].address].breaker.failures == 1
        assert workers[f.decode[0].address].breaker.failures == 0


REFUSED_PAIRING = {"fail_prefill": -1, "fail_code": grpc.StatusCode.FAILED_PRECONDITION,
                   "fail_message": "KV layouts incompatible: page_size: prefill=16 decode=1"}


async def test_a_refused_pairing_is_retried_elsewhere_and_never_a_client_error() -> None:
    async with fleet(prefill=[REFUSED_PAIRING, {}], decode=1, prefill_policy="round_robin") as f:
        for _ in range(2):  # one of them is routed to the misconfigured prefill first
            r = await f.openai().completions.create(model="mock-model", prompt="hi", max_tokens=1)
            assert r.usage.completion_tokens == 1
        assert len(f.prefill[0].received("prefill")) >= 1
    async with fleet(prefill=[REFUSED_PAIRING], decode=1, max_retries=1) as f:
        with pytest.raises(openai.APIStatusError) as e:
            await f.openai().completions.create(model="mock-model", prompt="hi", max_tokens=1)
        assert e.value.status_code == 503  # the cluster's misconfiguration, not a bad request


async def test_concurrent_requests_get_unique_rooms_and_finish() -> None:
    async with fleet(prefill=2, decode=2, common={"service_time": 0.005}) as f:
        client = f.openai()
        rs = await asyncio.gather(
            *(client.completions.create(model="mock-model", prompt=f"p{i}", max_tokens=2) for i in range(64))
        )
        assert all(r.usage.completion_tokens == 2 for r in rs)
        rooms = [r["room"] for w in f.prefill for r in w.received("prefill")]
        assert len(rooms) == 64 == len(set(rooms))
        assert f.server.service.pipeline.planner.rooms.in_flight == set()
        assert all(w.inflight == 0 for w in f.server.service.registry)


async def test_workers_removed_mid_round_leave_the_monitor_loops_running() -> None:
    """A worker removed while a health or load round is under way (its channel closes: calls raise UsageError)
    must not end those loops: a worker re-added later has to be probed and served again."""
    async with fleet(prefill=1, decode=1) as f:
        svc = f.server.service
        d = f.decode[0]
        for _ in range(12):
            assert svc.deregister(d.address)
            await asyncio.sleep(0.04)  # the channel closes while the round that listed the worker still polls it
            await svc.register(d.address, "decode", None)
        await asyncio.sleep(0.3)  # several health (0.1 s) and load (0.05 s) rounds
        assert not any(t.done() for t in svc.monitor._tasks), [t for t in svc.monitor._tasks if t.done()]
        await eventually(lambda: svc.registry.workers[d.address].routable)
        msgs = [m async for m in f.stub().Generate(gen())]
        assert msgs[-1].HasField("complete")
