"""Helpers of the Mux tests (tests/router/test_router_mux.py, tests/router/test_mux_socket.py,
tests/nodes/test_front_sink.py): a request, a leg read to its end, a mock worker with a ``MuxLink`` to it, and fake
scheduler ranks for a real node front."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc

from common.engine.io_struct import TokenOut
from common.node.front import WorkerServicer
from common.testing.mock_config import MockConfig
from common.testing.mock_worker import MockWorker
from pdcluster.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from router.mux import MuxLink


def gen_req(rid: str, ids: list[int], n: int = 4) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(rid=rid, input_ids=ids, sampling_params=common_pb2.SamplingParams(max_new_tokens=n))


async def read_all(call: Any) -> list[int]:
    """Token ids of a Generate/Decode leg through its Finished message."""
    ids: list[int] = []
    while True:
        msg = await call.read()
        assert msg is not grpc.aio.EOF
        if msg.WhichOneof("kind") == "chunk":
            ids += msg.chunk.token_ids
        else:
            return ids + list(msg.finished.last.token_ids)


@contextlib.asynccontextmanager
async def linked(**cfg: Any) -> AsyncIterator[tuple[MockWorker, MuxLink]]:
    """A colocated mock worker (its MockConfig fields in ``cfg``) and a MuxLink to it, on a plain channel."""
    w = MockWorker(MockConfig(role="colocated", **cfg))
    await w.start()
    channel = grpc.aio.insecure_channel(w.address)
    link = MuxLink(worker_pb2_grpc.WorkerStub(channel), w.address)
    try:
        yield w, link
    finally:
        link.close()
        await channel.close()
        await w.stop()


class FakeRanks:
    """Stands in for a node front's scheduler ranks (``common.node.ranks.RankClient``): takes requests and records
    what it is sent; the test answers a request with ``out(rid, token ids..., TokenOut fields)``."""

    def __init__(self) -> None:
        self.waiters: dict[str, Any] = {}
        self.rid_rank: dict[str, int] = {}
        self.sent: list[Any] = []

    def register(self, rid: str, rank: int, put: Any) -> None:
        self.waiters[rid], self.rid_rank[rid] = put, rank

    def unregister(self, rid: str) -> None:
        self.waiters.pop(rid, None)
        self.rid_rank.pop(rid, None)

    def send(self, rank: int, msg: Any) -> None:
        self.sent.append(msg)

    def least_loaded_rank(self) -> int:
        return 0

    def out(self, rid: str, *ids: int, **kw: Any) -> None:
        self.waiters[rid](TokenOut(rid=rid, token_ids=list(ids), **kw))


@contextlib.asynccontextmanager
async def fake_ranks_front() -> AsyncIterator[tuple[FakeRanks, WorkerServicer, Any, worker_pb2_grpc.WorkerStub]]:
    """A real colocated node front (``WorkerServicer``) over ``FakeRanks``, served on a gRPC port: (ranks, front, a
    Mux stream to it from a ``MuxLink``, a stub for its per-request RPCs)."""
    args = SimpleNamespace(dp_size=1, max_running_requests=8, max_queued_requests=8, port=0, request_timeout=60.0,
                           disaggregation_mode="null")
    ranks = FakeRanks()
    node = WorkerServicer(args, "m", None, ranks)  # type: ignore[arg-type]
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(node, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = worker_pb2_grpc.WorkerStub(channel)
    link = MuxLink(stub, "node")
    try:
        stream = await link.get(5)
        assert stream is not None
        yield ranks, node, stream, stub
    finally:
        link.close()
        await channel.close()
        await server.stop(0)
