"""A streamed ``Router.Generate``'s messages (router/grpc_stream.py): tokens written from the Mux stream's message
callback through the writer (no wake-up of the request's event stream per token), deltas that queued during a write
merged into one chunk in order, and the event stream's error after what came before it (a client that goes:
tests/router/test_router_faults.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.errors import InvalidRequestError
from common.testing.mock_fleet import shared_model_dir
from common.testing.mock_requests import fake_tokens
from common.text.tokenizer import load_tokenizer
from pdcluster.v1 import common_pb2, router_pb2
from router.grpc_service import final_to_proto
from router.grpc_stream import GrpcStreamWriter
from router.request import Delta, Final
from router.testing import eventually, fleet

PACED = {"itl": 0.01}  # one token per message, apart: each reaches the router as a wake-up of its own


@pytest.fixture
def sink_writes(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The token ids of every delta a leg's sink handed to a ``GrpcStreamWriter``."""
    seen: list[list[int]] = []
    write = GrpcStreamWriter.write

    def counting(self: GrpcStreamWriter, delta: Delta) -> None:
        seen.append(list(delta.token_ids))
        write(self, delta)

    monkeypatch.setattr(GrpcStreamWriter, "write", counting)
    return seen


def _request(rid: str, max_new_tokens: int, **kw: Any) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(request_id=rid, text="Hello world", stream=True, sampling_params=
                                            common_pb2.SamplingParams(max_new_tokens=max_new_tokens), **kw)


@pytest.mark.parametrize("layout", ["pd", "colocated"])
async def test_paced_tokens_reach_the_client_through_the_writer_in_order(layout: str,
                                                                         sink_writes: list[list[int]]) -> None:
    roles = {"prefill": 1, "decode": 1} if layout == "pd" else {"prefill": 0, "decode": 0, "colocated": 1}
    tok = load_tokenizer(shared_model_dir())
    prompt = tok.encode("Hello world")
    async with fleet(**roles, common=PACED) as f:
        msgs = [m async for m in f.stub().Generate(_request("paced", 20))]
        *chunks, last = msgs
        assert all(m.HasField("chunk") for m in chunks) and last.HasField("complete")
        streamed = [t for m in chunks for t in m.chunk.token_ids]
        assert streamed == list(last.complete.output_ids) == fake_tokens(prompt, 20, 1536)
        assert "".join(m.chunk.text for m in chunks) == last.complete.text
        # the first and the last token (with the Finished) may come through the event stream; most of the others
        # come from the leg's sink, in their place
        taken = [t for ids in sink_writes for t in ids]
        assert len(taken) >= 10 and any(streamed[k : k + len(taken)] == taken for k in range(len(streamed)))
        await eventually(lambda: not f.server.service.pipeline.active)


async def test_a_streaming_handler_that_writes_passes_the_parse_guard() -> None:
    """Health.Watch writes with ``context.write`` (no generator): the interceptor must run it as such."""
    async with fleet(prefill=1, decode=1) as f:
        channel = grpc.aio.insecure_channel(f.server.grpc_address)
        try:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            first = await asyncio.wait_for(watch.read(), 5)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        finally:
            await channel.close()


class _SlowClient:
    """A ``grpc.aio`` servicer context whose every write takes until ``release`` (a slow reader)."""

    def __init__(self) -> None:
        self.sent: list[router_pb2.RouterGenerateResponse] = []
        self.writing = asyncio.Event()
        self.release = asyncio.Event()

    async def write(self, msg: router_pb2.RouterGenerateResponse) -> None:
        self.sent.append(msg)
        self.writing.set()
        await self.release.wait()
        self.release.clear()


def _final(ids: list[int]) -> Final:
    return Final(rid="r", text="abcd", output_ids=ids, finish_reason="length", prompt_tokens=2,
                 completion_tokens=len(ids), cached_tokens=0, served_by="w", timing={"attempts": 1})


async def _release_all(client: _SlowClient, task: asyncio.Task[None]) -> None:
    while not task.done():
        client.release.set()
        await asyncio.sleep(0)
    await task


async def test_deltas_queued_during_a_write_leave_as_one_chunk_in_order() -> None:
    client = _SlowClient()
    writer = GrpcStreamWriter(client, final_to_proto)
    last = asyncio.Event()

    async def events() -> AsyncIterator[tuple[int, Delta | Final]]:
        yield 0, Delta("a", [1], [-0.5])
        await last.wait()
        yield 0, _final([1, 2, 3, 4])

    task = asyncio.create_task(writer.serve(events()))
    await asyncio.wait_for(client.writing.wait(), 5)  # the first delta's write is in flight
    for text, tid in (("b", 2), ("c", 3), ("d", 4)):  # a leg's sink, while it is
        assert writer.ready()
        writer.write(Delta(text, [tid], [-float(tid)]))
    last.set()
    await asyncio.wait_for(_release_all(client, task), 5)
    kinds = [m.WhichOneof("kind") for m in client.sent]
    assert kinds == ["chunk", "chunk", "complete"]
    merged = client.sent[1].chunk
    assert (merged.text, list(merged.token_ids), list(merged.logprobs)) == ("bcd", [2, 3, 4], [-2.0, -3.0, -4.0])
    assert list(client.sent[2].complete.output_ids) == [1, 2, 3, 4]
    assert not writer.ready()


async def test_an_error_of_the_event_stream_follows_what_came_before_it() -> None:
    client = _SlowClient()
    writer = GrpcStreamWriter(client, final_to_proto)

    async def events() -> AsyncIterator[tuple[int, Delta | Final]]:
        yield 0, Delta("a", [1])
        yield 1, Delta("b", [2])
        raise InvalidRequestError("bad")

    task = asyncio.create_task(writer.serve(events()))
    with pytest.raises(InvalidRequestError):
        await asyncio.wait_for(_release_all(client, task), 5)
    # two choices' deltas are never merged; both went out before the error
    assert [(m.chunk.index, list(m.chunk.token_ids)) for m in client.sent] == [(0, [1]), (1, [2])]
