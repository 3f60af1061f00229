"""Worker.Mux: the router's one multiplexed stream per worker (router/mux.py) over the node-side adapter
(common/node/worker_mux.py), against in-process mock workers and a node front over fake ranks."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from common.engine.io_struct import AbortReq
from common.errors import ErrorCode
from common.testing.mock_requests import fake_tokens
from common.wire.mux_frames import FRAGMENT_BYTES, FrameWriter, Reassembler
from pdcluster.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from router.mux import MuxLink, MuxStream
from router.testing import eventually, fleet
from tests.mux_helpers import fake_ranks_front, gen_req, linked, read_all


async def test_many_concurrent_pd_requests_ride_one_stream_per_worker() -> None:
    async with fleet(prefill=1, decode=1, common={"service_time": 0.01}) as f:
        stub = f.stub()

        async def one(i: int) -> router_pb2.RouterGenerateResponse:
            req = router_pb2.RouterGenerateRequest(
                request_id=f"r{i}", input_ids=router_pb2.TokenIds(ids=[10 + i, 11, 12]),
                sampling_params=common_pb2.SamplingParams(max_new_tokens=3),
            )
            return [m async for m in stub.Generate(req)][-1]

        done = await asyncio.gather(*(one(i) for i in range(48)))
        assert [list(m.complete.output_ids) for m in done] == [fake_tokens([10 + i, 11, 12], 3, 1536) for i in range(48)]
        for w in f.workers:
            methods = [m for m, _ in w.calls]
            assert methods.count("Mux") == 1 and "Prefill" not in methods and "Decode" not in methods
        assert len(f.prefill[0].received("prefill")) == len(f.decode[0].received("decode")) == 48
        assert f.server.service.core.rooms.in_flight == set()


async def test_cancel_of_one_request_reaches_the_worker_and_leaves_the_others_running() -> None:
    async with linked(itl=0.01) as (w, link):
        stream = await link.get(5)
        assert stream is not None
        calls = [stream.open("generate", gen_req(f"c{i}", [5, i + 6], n=30), 10) for i in range(5)]
        for c in calls:
            assert (await c.read()).WhichOneof("kind") == "chunk"
        assert calls[2].cancel()
        with pytest.raises(asyncio.CancelledError):
            await calls[2].read()
        rest = [read_all(c) for i, c in enumerate(calls) if i != 2]
        outs = await asyncio.wait_for(asyncio.gather(*rest), 10)
        assert [len(o) for o in outs] == [29] * 4  # the first chunk was read above
        deadline = time.monotonic() + 3
        while "c2" not in w.cancelled:
            assert time.monotonic() < deadline, "the cancel frame never reached the worker"
            await asyncio.sleep(0.01)
        assert w.cancelled == ["c2"] and not w.active
        assert [m for m, _ in w.calls].count("Mux") == 1


async def test_a_request_deadline_ends_only_that_request_on_both_ends() -> None:
    async with linked(hang=True) as (w, link):
        stream = await link.get(5)
        assert stream is not None
        short = stream.open("generate", gen_req("short", [7, 8]), 0.3)
        long = stream.open("generate", gen_req("long", [7, 9]), 30)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await short.read()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 1.5
        deadline = time.monotonic() + 3
        while "short" not in w.cancelled:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert set(w.active) == {"long"} and stream.alive
        long.cancel()


async def test_a_dying_stream_fails_exactly_its_requests_and_the_next_request_reconnects() -> None:
    async with linked(itl=0.02) as (a, link_a), linked(itl=0.02) as (_b, link_b):
        sa, sb = await link_a.get(5), await link_b.get(5)
        assert sa is not None and sb is not None
        on_a = [sa.open("generate", gen_req(f"a{i}", [3, i + 4], n=100), 10) for i in range(3)]
        on_b = [sb.open("generate", gen_req(f"b{i}", [3, i + 4], n=20), 10) for i in range(2)]
        for c in on_a + on_b:
            await c.read()
        port = a.port
        await a.stop()
        for c in on_a:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(read_all(c), 5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not sa.alive and sa.calls == {}
        assert [len(o) for o in await asyncio.gather(*(read_all(c) for c in on_b))] == [19, 19]
        await a.start(port)
        again = await link_a.get(5)
        assert again is not None and again is not sa
        out = await read_all(again.open("generate", gen_req("a-again", [3, 4], n=5), 10))
        assert out == fake_tokens([3, 4], 5, 1536)


async def test_a_worker_without_mux_is_served_by_per_request_rpcs() -> None:
    async with fleet(prefill=[{"serve_mux": False}], decode=1, colocated=0) as f:
        stub = f.stub()
        for i in range(3):
            req = router_pb2.RouterGenerateRequest(
                input_ids=router_pb2.TokenIds(ids=[20, 21 + i]), sampling_params=common_pb2.SamplingParams(max_new_tokens=2)
            )
            msgs = [m async for m in stub.Generate(req)]
            assert list(msgs[-1].complete.output_ids) == fake_tokens([20, 21 + i], 2, 1536)
        p_methods = [m for m, _ in f.prefill[0].calls]
        d_methods = [m for m, _ in f.decode[0].calls]
        assert p_methods.count("Mux") == 1 and p_methods.count("Prefill") == 3
        assert d_methods.count("Mux") == 1 and "Decode" not in d_methods
        legs = {s["role"]: s["legs_transport"] for s in f.server.service.list_workers()}
        assert legs == {"prefill": "rpc", "decode": "socket"}


async def test_a_large_message_goes_out_in_fragments_interleaved_with_small_ones() -> None:
    frames: list[worker_pb2.MuxFrame] = []

    async def write(frame: worker_pb2.MuxFrame) -> None:
        frames.append(frame)
        await asyncio.sleep(0)

    writer = FrameWriter(write, lambda e: None)
    big = worker_pb2.MuxMessage(stream_id=1, generate=gen_req("big", list(range(100_000, 400_000))))
    writer.send(big)
    writer.send(worker_pb2.MuxMessage(stream_id=2, generate=gen_req("small", [1, 2])))
    while len(frames) < 2 or any(m.fragment.more for m in frames[-1].messages):
        await asyncio.sleep(0)
    writer.close()
    assert big.ByteSize() > 4 * FRAGMENT_BYTES and len(frames) > 4
    assert [m.stream_id for m in frames[0].messages] == [1, 2]  # the small one is not behind the big one
    parts, whole = Reassembler(), []
    for f in frames:
        for m in f.messages:
            assert m.ByteSize() <= FRAGMENT_BYTES + 64
            if (done := parts.whole(m)) is not None:
                whole.append(done)
    assert [m.generate.rid for m in whole] == ["small", "big"] and whole[1] == big


async def test_one_streams_messages_keep_their_order_around_large_ones() -> None:
    """What a stream queues behind its large message (a small one, another large one) goes out after it; another
    stream's small message does not wait."""
    frames: list[worker_pb2.MuxFrame] = []

    async def write(frame: worker_pb2.MuxFrame) -> None:
        frames.append(frame)
        await asyncio.sleep(0)

    writer = FrameWriter(write, lambda e: None)
    sent = [worker_pb2.MuxMessage(stream_id=1, generate=gen_req(rid, ids)) for rid, ids in (
        ("big-a", list(range(100_000, 200_000))), ("small-a", [1]), ("big-b", list(range(300_000, 400_000))),
        ("small-b", [2]))]
    for m in sent[:2]:
        writer.send(m)
    writer.send(worker_pb2.MuxMessage(stream_id=2, generate=gen_req("other", [3])))
    for m in sent[2:]:
        writer.send(m)
    await eventually(lambda: sum(m.WhichOneof("kind") != "fragment" or not m.fragment.more
                                 for f in frames for m in f.messages) == 5)
    writer.close()
    parts, whole = Reassembler(), []
    for f in frames:
        whole += [done for m in f.messages if (done := parts.whole(m)) is not None]
    assert [m.generate.rid for m in whole if m.stream_id == 1] == ["big-a", "small-a", "big-b", "small-b"]
    assert [m for m in whole if m.stream_id == 1] == sent
    assert [m.generate.rid for m in frames[0].messages if m.stream_id == 2] == ["other"]


async def test_the_router_reassembles_a_fragmented_answer_between_small_ones() -> None:
    """A node's message over FRAGMENT_BYTES reaches its call whole, in order with the small ones around it, while
    other calls' tokens keep arriving between its fragments."""

    class Io:
        def start(self, on_frame: Any, on_end: Any) -> None:
            self.on_frame = on_frame

        async def write(self, frame: worker_pb2.MuxFrame) -> None:
            pass

        def close(self) -> None:
            pass

    io = Io()
    stream = MuxStream(io, "node:1")  # type: ignore[arg-type]
    big_call, small_call = stream.open("generate", gen_req("big", [1]), 10), stream.open("generate", gen_req("s", [1]), 10)

    def answer(sid: int, ids: list[int]) -> worker_pb2.MuxMessage:
        return worker_pb2.MuxMessage(stream_id=sid, response=worker_pb2.GenerateResponse(
            chunk=worker_pb2.TokenChunk(token_ids=ids)))

    frames: list[worker_pb2.MuxFrame] = []

    async def sent(frame: worker_pb2.MuxFrame) -> None:
        frames.append(frame)
        await asyncio.sleep(0)

    node = FrameWriter(sent, lambda e: None)  # the node's side: it fragments the big answer
    node.send(answer(big_call.sid, [7]))
    node.send(answer(big_call.sid, list(range(100_000, 200_000))))
    node.send(answer(big_call.sid, [8]))
    for t in range(6):
        node.send(answer(small_call.sid, [t]))
        await asyncio.sleep(0)
    await eventually(lambda: sum(len(f.messages) for f in frames) >= 6 + 2 + 100_000 * 4 // FRAGMENT_BYTES)
    node.close()
    assert any(m.WhichOneof("kind") == "fragment" for f in frames for m in f.messages)
    for f in frames:
        io.on_frame(f)
    big = [list((await big_call.read()).chunk.token_ids) for _ in range(3)]
    assert big == [[7], list(range(100_000, 200_000)), [8]]
    assert [list((await small_call.read()).chunk.token_ids) for _ in range(6)] == [[t] for t in range(6)]
    stream.close()


async def test_a_node_tells_its_ranks_a_deadline_from_a_cancel() -> None:
    async with fake_ranks_front() as (ranks, node, stream, stub):
        expiring = stream.open("generate", gen_req("mux-late", [1, 2]), 0.2)
        cancelled = stream.open("generate", gen_req("mux-gone", [1, 2]), 30)
        with pytest.raises(grpc.aio.AioRpcError):
            await expiring.read()
        await asyncio.sleep(0.05)
        cancelled.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(gen_req("rpc-late", [1, 2]), timeout=0.2):
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 3
        while len([m for m in ranks.sent if isinstance(m, AbortReq)]) < 3:
            assert time.monotonic() < deadline, ranks.sent
            await asyncio.sleep(0.01)
        codes = {m.rid: m.code for m in ranks.sent if isinstance(m, AbortReq)}
        assert codes == {"mux-late": ErrorCode.DEADLINE_EXCEEDED, "mux-gone": ErrorCode.CANCELLED,
                         "rpc-late": ErrorCode.DEADLINE_EXCEEDED}
        assert ranks.waiters == {} and node.in_flight == [0]


class _MuteMux(worker_pb2_grpc.WorkerServicer):
    """Takes a Mux stream and never answers it (no initial metadata): a hung node."""

    def __init__(self) -> None:
        self.opened = 0

    async def Mux(self, request_iterator: Any, context: Any) -> None:
        self.opened += 1
        await asyncio.sleep(30)


async def test_a_node_that_never_answers_a_new_stream_fails_its_open_in_time(monkeypatch) -> None:
    monkeypatch.setattr("router.mux.OPEN_TIMEOUT_S", 0.5)
    servicer = _MuteMux()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            link = MuxLink(worker_pb2_grpc.WorkerStub(ch), f"127.0.0.1:{port}")
            for expected_opens in (1, 2):  # the failed open is not left pending: the next request tries again
                t0 = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await link.get(timeout=10.0)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 3.0
                assert servicer.opened == expected_opens
            link.close()
    finally:
        await server.stop(None)


async def test_a_node_pushes_its_load_on_the_stream_and_polls_stop() -> None:
    async with fleet(prefill=1, decode=1, colocated=0) as f:
        reg = f.server.service.registry
        d = f.decode[0]
        w = reg.workers[d.address]
        await eventually(lambda: w.mux.pushed_load_age() is not None, timeout=5.0)  # opened by the monitor

        def polls() -> int:
            return [m for m, _ in d.calls].count("GetLoad")

        # The round that opened the stream still polls once (its GetLoad may land after the first push): wait until
        # no poll came for 4 load intervals. Were polls still going, none of those windows would be quiet.
        deadline = asyncio.get_running_loop().time() + 5.0
        before = polls()
        while True:
            await asyncio.sleep(0.2)
            if polls() == before:
                break
            assert asyncio.get_running_loop().time() < deadline, "GetLoad polls go on while the node pushes its load"
            before = polls()
        d.cfg.free_kv_pages = 17  # the node's load changes: the router learns it without a poll
        await eventually(lambda: w.ranks[0].report is not None and w.ranks[0].report.free_kv_pages == 17)
        await asyncio.sleep(0.3)  # 6 load intervals
        assert polls() == before
        # The stream goes: polls come back (and a new stream is opened, whose pushes take over again).
        w.mux.stream.close()
        d.cfg.free_kv_pages = 23
        await eventually(lambda: w.ranks[0].report.free_kv_pages == 23)
        await eventually(lambda: w.mux.pushed_load_age() is not None, timeout=5.0)


async def test_a_load_report_that_raises_skips_one_round_and_pushes_go_on(monkeypatch) -> None:
    async with fleet(prefill=1, decode=1, colocated=0) as f:
        d = f.decode[0]
        w = f.server.service.registry.workers[d.address]
        await eventually(lambda: w.mux.pushed_load_age() is not None, timeout=5.0)
        real = d.GetLoad
        raised = []

        async def flaky(request: Any, context: Any) -> Any:
            if not raised:
                raised.append(1)
                raise RuntimeError("injected load failure")
            return await real(request, context)

        monkeypatch.setattr(d, "GetLoad", flaky)
        await eventually(lambda: bool(raised))
        d.cfg.free_kv_pages = 19  # a later round still reaches the router on the same stream
        stream = w.mux.stream
        await eventually(lambda: w.ranks[0].report is not None and w.ranks[0].report.free_kv_pages == 19)
        assert w.mux.stream is stream and stream.alive
