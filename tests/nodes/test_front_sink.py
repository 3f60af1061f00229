"""A node front on a Mux stream sends a token chunk from its ranks' output callback (``MuxCallContext.sink``) instead
of waking the request's handler task: the same messages in the same order as a per-request RPC gets, finals and
errors still from the handler, nothing sent for a cancelled request."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from common.engine.io_struct import AbortReq, TokenOut
from common.errors import ErrorCode
from common.node import worker_mux
from pdcluster.v1 import worker_pb2
from router.testing import eventually
from tests.mux_helpers import FakeRanks, fake_ranks_front, gen_req


@pytest.fixture
def responded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The stream ids of every response a node front sent through a sink."""
    seen: list[int] = []
    respond = worker_mux.MuxSession._respond

    def counting(self: worker_mux.MuxSession, sid: int, item: worker_pb2.GenerateResponse) -> None:
        seen.append(sid)
        respond(self, sid, item)

    monkeypatch.setattr(worker_mux.MuxSession, "_respond", counting)
    return seen


async def _read(call: Any, timeout: float = 5.0) -> list[tuple[str, list[int]]]:
    """(kind, token ids) of each message through the end of the leg, or ("error", [code]) for its failure."""
    got: list[tuple[str, list[int]]] = []
    while True:
        try:
            msg = await asyncio.wait_for(call.read(), timeout)
        except grpc.aio.AioRpcError as e:
            return [*got, ("error", [e.code().value[0]])]
        if msg is grpc.aio.EOF:
            return got
        kind = msg.WhichOneof("kind")
        ids = msg.chunk.token_ids if kind == "chunk" else msg.finished.last.token_ids
        got.append((kind, list(ids)))


async def _drive(ranks: FakeRanks, rid: str, paced: bool) -> None:
    await eventually(lambda: rid in ranks.waiters)
    for t in range(1, 9):
        ranks.out(rid, t)
        if paced:
            await asyncio.sleep(0.005)  # the front's handler waits again before the next
    ranks.out(rid, 9, finish_reason="length", completion_tokens=9)


@pytest.mark.parametrize("paced", [True, False])
async def test_mux_gets_the_per_request_rpcs_messages_in_order(paced: bool, responded: list[int]) -> None:
    async with fake_ranks_front() as (ranks, _node, stream, stub):
        call = stream.open("generate", gen_req("mux", [1, 2]), 30)
        driver = asyncio.create_task(_drive(ranks, "mux", paced))
        via_mux = await _read(call)
        await driver
        rpc = stub.Generate(gen_req("rpc", [1, 2]), timeout=30)
        driver = asyncio.create_task(_drive(ranks, "rpc", paced))
        via_rpc = [(m.WhichOneof("kind"), list(m.chunk.token_ids if m.HasField("chunk") else m.finished.last.token_ids))
                   async for m in rpc]
        await driver
    assert via_mux == via_rpc == [*(("chunk", [t]) for t in range(1, 9)), ("finished", [9])]
    if paced:
        assert len(responded) >= 6  # all but the first chunk or so went out from the ranks' callback
    assert ranks.waiters == {}


async def test_an_error_after_sink_sent_chunks_ends_the_request_with_its_code(responded: list[int]) -> None:
    async with fake_ranks_front() as (ranks, _node, stream, _stub):
        call = stream.open("generate", gen_req("err", [1, 2]), 30)
        reading = asyncio.create_task(_read(call))
        await eventually(lambda: "err" in ranks.waiters)
        for t in (1, 2, 3):
            ranks.out("err", t)
            await asyncio.sleep(0.005)
        ranks.out("err", finish_reason="abort", error="peer gone", error_code=ErrorCode.UNAVAILABLE)
        got = await reading
    assert got == [("chunk", [1]), ("chunk", [2]), ("chunk", [3]), ("error", [grpc.StatusCode.UNAVAILABLE.value[0]])]
    assert responded


async def test_a_cancelled_request_sends_nothing_more_and_aborts_on_its_rank(responded: list[int]) -> None:
    async with fake_ranks_front() as (ranks, _node, stream, _stub):
        call = stream.open("generate", gen_req("gone", [1, 2]), 30)
        await eventually(lambda: "gone" in ranks.waiters)
        deliver = ranks.waiters["gone"]
        ranks.out("gone", 1)
        assert (await asyncio.wait_for(call.read(), 5)).chunk.token_ids == [1]
        for t in (2, 3):
            ranks.out("gone", t)
            await asyncio.sleep(0.005)
        call.cancel()
        sent_before = len(responded)
        await eventually(lambda: any(isinstance(m, AbortReq) and m.rid == "gone" for m in ranks.sent))
        deliver(TokenOut(rid="gone", token_ids=[4]))  # a late output of the cancelled request
        assert len(responded) == sent_before and ranks.waiters == {}


async def test_a_send_that_raises_in_the_callback_leaves_the_output_to_the_handler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: worker_mux.MuxSession, sid: int, item: worker_pb2.GenerateResponse) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(worker_mux.MuxSession, "_respond", broken)
    async with fake_ranks_front() as (ranks, _node, stream, _stub):
        for rid in ("bad", "after"):  # the ranks' output dispatcher carries on after the first request's failures
            call = stream.open("generate", gen_req(rid, [1, 2]), 30)
            driver = asyncio.create_task(_drive(ranks, rid, paced=True))
            got = await _read(call)
            await driver
            assert got == [*(("chunk", [t]) for t in range(1, 9)), ("finished", [9])]
