"""Helpers of the Mux tests (tests/router/test_router_mux.py, tests/router/test_mux_socket.py): a request, a leg read to its end,
and a mock worker with a ``MuxLink`` to it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from common.testing.mock_worker import MockConfig, MockWorker
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
