"""Large prompts tokenize off the router's event loop (router/tokenize_pool.py) and never stall other requests."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time

import aiohttp
import grpc
import pytest

from common.testing.mock_fleet import shared_model_dir
from common.text.tokenizer import load_tokenizer
from pdcluster.v1 import router_pb2
from router.request import ClientRequest
from router.testing import eventually, fleet
from router.tokenizer import Tokenizer

BIG = 3_900_000  # bytes: ~2.4M tokens of the mock tokenizer, ~7 s to encode on a loaded 2-core machine
# The mock's context raised so BIG prompts fit (and its KV, so the mock accepts them).
HUGE_CONTEXT = {"context_len": 1 << 23, "total_kv_pages": 1 << 20}


def words(nbytes: int) -> str:
    return ("the quick brown fox jumps over the lazy dog 12345 " * (nbytes // 50 + 1))[:nbytes]


async def latencies(session: aiohttp.ClientSession, base: str, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"small": [], "liveness": []}
    for _ in range(n):
        for name, method, path, body in (
            ("small", "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 1}),
            ("liveness", "GET", "/liveness", None),
        ):
            t = time.perf_counter()
            async with session.request(method, base + path, json=body) as r:
                await r.read()
                assert r.status == 200
            out[name].append(time.perf_counter() - t)
        await asyncio.sleep(0.05)
    return out


async def test_large_prompts_leave_small_requests_and_liveness_fast() -> None:
    async with fleet(common=HUGE_CONTEXT) as f, aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        base = f.server.http_url
        pool = f.server.service.inputs.pool
        assert pool is not None
        idle = await latencies(session, base, 10)
        big = [
            asyncio.create_task(session.post(base + "/v1/completions", json={"prompt": words(BIG), "max_tokens": 1}))
            for _ in range(4)
        ]
        await eventually(lambda: pool.busy == pool.size, timeout=60)  # includes the fork server's first start
        storm = await latencies(session, base, 10)
        assert pool.busy == pool.size, "the storm ended before the probes did; the probes measured nothing"
        # Margin for a loaded 2-core CI machine (both cores busy encoding): 100 ms on the median, 500 ms on the
        # worst probe. Tokenizing one BIG prompt inline blocks the loop for seconds.
        for name in ("small", "liveness"):
            assert statistics.median(storm[name]) < statistics.median(idle[name]) + 0.1, (name, idle, storm)
            assert max(storm[name]) < max(idle[name]) + 0.5, (name, idle, storm)

        # Clients that go away free their workers at once: killed and replaced, not left encoding for seconds.
        for t in big:
            t.cancel()
        await asyncio.gather(*big, return_exceptions=True)
        await eventually(lambda: pool.busy == 0, timeout=2)
        t0 = time.perf_counter()
        async with session.post(base + "/v1/completions", json={"prompt": words(64 << 10), "max_tokens": 1}) as r:
            assert r.status == 200, await r.text()
        assert time.perf_counter() - t0 < 3.0  # the cancelled encodes alone would hold both workers for seconds


async def test_prompt_that_cannot_fit_is_refused_before_tokenization() -> None:
    async with fleet() as f, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        inputs = f.server.service.inputs
        limit = inputs.max_prompt_bytes
        assert limit is not None and inputs.context_len == 2048
        prompt = words(limit + 1)
        async with session.post(
            f.server.http_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}
        ) as r:
            assert r.status == 400
            message = (await r.json())["error"]["message"]
        assert f"{limit + 1} bytes" in message and f"limit of {limit} bytes" in message and "2048 tokens" in message
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await f.stub().Generate(router_pb2.RouterGenerateRequest(text=prompt)).read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"limit of {limit} bytes" in e.value.details()
        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
        async with session.post(f.server.http_url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 400 and "messages:" in (await r.json())["error"]["message"]
        assert inputs.pool is not None and not inputs.pool.started  # nothing was tokenized


async def test_medium_prompts_tokenize_in_the_pool_like_inline() -> None:
    async with fleet(common=HUGE_CONTEXT) as f:
        inputs = f.server.service.inputs
        text = words(inputs.inline_bytes * 3)
        chat = [{"role": "user", "content": text}]
        pooled = await inputs.build(ClientRequest(rid="a", api="completions", sampling={}, text=text))
        pooled_chat = await inputs.build(ClientRequest(rid="b", api="chat", sampling={}, messages=chat))
        assert inputs.pool is not None and inputs.pool.started
        assert pooled.input_ids == inputs.tok.encode(text)
        assert pooled_chat.input_ids == inputs.tok.encode_chat(chat)

        # Workers killed while idle (the OOM killer's way) are replaced when found, and the job still runs.
        pool = inputs.pool
        await eventually(lambda: pool.idle == pool.size, timeout=30)
        dead = pool.idle_pids()
        for pid in dead:
            os.kill(pid, signal.SIGKILL)
        await eventually(lambda: all(not _alive(pid) for pid in dead), timeout=10)
        again = await inputs.build(ClientRequest(rid="c", api="completions", sampling={}, text=text))
        assert again.input_ids == pooled.input_ids
        assert not set(pool.idle_pids()) & set(dead)


def _alive(pid: int) -> bool:
    """False once the process is gone or a zombie (killed, not yet reaped by the pool)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return False


async def test_tokenizer_caches_serve_inline_and_pooled_prompts() -> None:
    async with fleet(common=HUGE_CONTEXT, tokenizer_cache_enable_l0=True, tokenizer_cache_enable_l1=True) as f:
        inputs = f.server.service.inputs
        plain = Tokenizer(load_tokenizer(shared_model_dir()))
        system = {"role": "system", "content": "Answer in one word. "}
        long = words(inputs.inline_bytes * 2)
        for i, content in enumerate(["hi", "hi", "hello", long, long]):
            chat = [system, {"role": "user", "content": content}]
            built = await inputs.build(ClientRequest(rid=f"c{i}", api="chat", sampling={}, messages=chat))
            assert built.input_ids == plain.encode_chat(chat)
        assert inputs.pool is not None and inputs.pool.started  # the long ones went to a worker (its own L1)
        text = f.server.service.metrics.render().decode()
        assert 'pdcluster_router_tokenizer_cache_lookups_total{level="l0",result="hit"} 1.0' in text
        # L1, of 6 pieces each: "hi" found its second "\n<|im_start|>"; "hello" all but "user\nhello<|im_end|>"
        assert 'pdcluster_router_tokenizer_cache_lookups_total{level="l1",result="hit"} 6.0' in text
        assert 'pdcluster_router_tokenizer_cache_lookups_total{level="l1",result="miss"} 6.0' in text
