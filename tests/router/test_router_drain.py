"""Graceful router shutdown: SIGTERM (the real handler of ``pdcluster router``, on this test's loop) in front of mock
workers - streams in flight finish, new requests are refused cleanly, what outlives ``--drain-timeout`` is aborted
on both nodes."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdcluster.v1 import common_pb2, router_pb2
from router.cli import serve_until_signal
from router.drain import CUT_SHORT, REFUSED
from router.testing import eventually, fleet

DRAIN_S = 3.0  # the short stream needs ~0.4 s of it; the long one 50 s


def gen(rid: str, n: int) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(request_id=rid, text="drain me", stream=True,
                                            sampling_params=common_pb2.SamplingParams(max_new_tokens=n))


async def test_sigterm_drains_streams_refuses_new_ones_then_aborts_the_rest() -> None:
    async with fleet(prefill=1, decode=1, common={"itl": 0.05}, drain_timeout_s=DRAIN_S) as f:
        serving = asyncio.create_task(serve_until_signal(f.server))
        client, stub = f.openai(), f.stub()
        short = await client.completions.create(model="mock-model", prompt="short", max_tokens=8, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_headers={"X-Request-ID": "short"})
        long = stub.Generate(gen("long", 1000)).__aiter__()
        short_chunks = [await short.__anext__()]  # both streams are under way ...
        await long.__anext__()
        os.kill(os.getpid(), signal.SIGTERM)  # ... when the router is told to stop
        await eventually(lambda: f.server.service.drain.draining)
        t_term = time.monotonic()

        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(model="mock-model", prompt="new", max_tokens=2)
        assert refused.value.status_code == 503 and REFUSED in str(refused.value)
        with pytest.raises(grpc.aio.AioRpcError) as refused_rpc:
            async for _ in stub.Generate(gen("new-rpc", 2)):
                pass
        assert refused_rpc.value.code() == grpc.StatusCode.UNAVAILABLE and REFUSED in refused_rpc.value.details()
        async with aiohttp.ClientSession() as http, http.get(f.server.http_url + "/health") as ready:
            assert ready.status == 503  # readiness false: a load balancer stops sending
        async with grpc.aio.insecure_channel(f.server.grpc_address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

        short_chunks += [c async for c in short]  # the short stream finishes within the drain
        assert short_chunks[-2].choices[0].finish_reason == "length"
        assert short_chunks[-1].usage.completion_tokens == 8
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            async for _ in long:
                pass
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and CUT_SHORT in cut.value.details()
        assert DRAIN_S - 0.2 <= time.monotonic() - t_term < DRAIN_S + 10
        p, d = f.prefill[0], f.decode[0]
        await eventually(lambda: "long" in p.aborts and "long" in d.aborts)  # both legs, through the abort path
        await asyncio.wait_for(serving, 10)
        assert "short" not in d.aborts and not d.active and f.server.service.pipeline.active == set()


def test_drain_timeout_flag_reaches_the_config_and_is_checked() -> None:
    import argparse

    from common.errors import ConfigError
    from router.cli import add_router_args, config_from_args
    from router.config import RouterConfig

    p = argparse.ArgumentParser()
    add_router_args(p)
    assert config_from_args(p.parse_args([])).drain_timeout_s == RouterConfig().drain_timeout_s == 30.0
    assert config_from_args(p.parse_args(["--drain-timeout", "2.5"])).drain_timeout_s == 2.5
    with pytest.raises(ConfigError, match="--drain-timeout"):
        config_from_args(p.parse_args(["--drain-timeout", "-1"]))
