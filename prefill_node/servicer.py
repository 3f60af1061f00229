"""The prefill node's gRPC surface: ``Worker.Prefill`` plus the Bootstrap service on its own port."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from common.config import ServerArgs
from common.engine.io_struct import PrefillDone
from common.errors import InvalidRequestError
from common.node.convert import request_from_proto, timing_to_proto
from common.node.front import WorkerServicer
from kvtransfer.bootstrap import BootstrapServer
from pdcluster.v1 import worker_pb2

logger = logging.getLogger(__name__)


class PrefillServicer(WorkerServicer):
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> Any:
        async def body() -> Any:
            self.check_role("Prefill", "prefill")
            if not request.HasField("bootstrap_room"):
                raise InvalidRequestError("bootstrap_room is required: the router assigns one per request")
            msg = request_from_proto(request.request)
            msg.bootstrap_room = request.bootstrap_room
            rank = self.check_rank(
                request.prefill_dp_rank if request.HasField("prefill_dp_rank") else None, "prefill_dp_rank"
            )
            async for out in self.run_request(msg, rank, context):
                if out.error_code is not None:
                    await self.fail(context, out.error_code, out.error or "prefill failed", out.error_origin)
                if isinstance(out, PrefillDone):
                    yield worker_pb2.PrefillResponse(
                        rid=out.rid, prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
                        timing=timing_to_proto(out.timing),
                    )

        result = None
        async for response in self.guarded(context, body()):
            result = response
        return result


async def add_bootstrap_service(args: ServerArgs, servicer: WorkerServicer) -> Callable[[], Awaitable[None]]:
    """Serve ``pdcluster.v1.Bootstrap`` on ``--disaggregation-bootstrap-port`` before the ranks register."""
    server = BootstrapServer()
    port = server.start(args.host, args.disaggregation_bootstrap_port)
    if port == 0:
        raise OSError(f"cannot bind the bootstrap port {args.host}:{args.disaggregation_bootstrap_port}")
    logger.info("bootstrap service on %s:%d", args.host, port)

    async def stop() -> None:
        server.stop()

    return stop
