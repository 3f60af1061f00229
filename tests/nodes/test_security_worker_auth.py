"""The node-RPC credential: a Worker server refuses calls without it, and the router's channel sends it on unary
and streaming calls alike."""

from __future__ import annotations

import grpc
import pytest

from common.node.worker_mux import MuxServing
from common.wire.worker_auth import WorkerAuthInterceptor, aio_worker_channel
from pdcluster.v1 import worker_pb2, worker_pb2_grpc
from router.mux.link import MuxLink


class _Servicer(MuxServing, worker_pb2_grpc.WorkerServicer):
    async def GetServerInfo(self, request, context):  # type: ignore[no-untyped-def]
        return worker_pb2.ServerInfo(model_path="m")

    async def Decode(self, request, context):  # type: ignore[no-untyped-def]
        yield worker_pb2.GenerateResponse(chunk=worker_pb2.TokenChunk(token_ids=[7]))


async def test_router_channel_carries_the_credential_and_bare_calls_are_refused() -> None:
    server = grpc.aio.server(interceptors=[WorkerAuthInterceptor()])
    worker_pb2_grpc.add_WorkerServicer_to_server(_Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio_worker_channel(f"127.0.0.1:{port}") as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            assert (await stub.GetServerInfo(worker_pb2.GetServerInfoRequest())).model_path == "m"
            assert [list(m.chunk.token_ids) async for m in stub.Decode(worker_pb2.DecodeRequest())] == [[7]]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as bare:
            stub = worker_pb2_grpc.WorkerStub(bare)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetServerInfo(worker_pb2.GetServerInfoRequest())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Decode(worker_pb2.DecodeRequest()):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(None)


async def test_mux_stream_carries_the_credential_and_a_bare_one_is_refused_not_left_hanging() -> None:
    server = grpc.aio.server(interceptors=[WorkerAuthInterceptor()])
    worker_pb2_grpc.add_WorkerServicer_to_server(_Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio_worker_channel(f"127.0.0.1:{port}") as ch:
            link = MuxLink(worker_pb2_grpc.WorkerStub(ch), f"127.0.0.1:{port}")
            stream = await link.get(timeout=5.0)
            assert stream is not None
            call = stream.open("decode", worker_pb2.DecodeRequest(), timeout=5.0)
            assert list((await call.read()).chunk.token_ids) == [7]
            assert await call.read() is grpc.aio.EOF
            link.close()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as bare:
            call = worker_pb2_grpc.WorkerStub(bare).Mux(timeout=5.0)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(None)
