"""The decode node's gRPC surface: ``Worker.Decode`` (server stream)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from common.errors import InvalidRequestError
from common.node.convert import request_from_proto
from common.node.front import WorkerServicer
from pdcluster.v1 import worker_pb2


class DecodeServicer(WorkerServicer):
    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        async def body() -> AsyncIterator[worker_pb2.GenerateResponse]:
            self.check_role("Decode", "decode")
            if not request.HasField("bootstrap_room"):
                raise InvalidRequestError("bootstrap_room is required: the router assigns one per request")
            if not request.bootstrap_addr:
                raise InvalidRequestError("bootstrap_addr is required: the prefill node's host:bootstrap_port")
            if request.HasField("prefill_dp_rank") and request.prefill_dp_rank < 0:
                raise InvalidRequestError(f"prefill_dp_rank must be >= 0, got {request.prefill_dp_rank}")
            msg = request_from_proto(request.request)
            msg.bootstrap_room = request.bootstrap_room
            msg.bootstrap_addr = request.bootstrap_addr
            msg.prefill_dp_rank = request.prefill_dp_rank if request.HasField("prefill_dp_rank") else 0
            rank = self.check_rank(
                request.decode_dp_rank if request.HasField("decode_dp_rank") else None, "decode_dp_rank"
            )
            async for resp in self.stream_tokens(msg, rank, context):
                yield resp

        async for resp in self.guarded(context, body()):
            yield resp
