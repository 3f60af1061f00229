"""Garbage protobuf is the client's error: a request that does not parse gets INVALID_ARGUMENT, not UNKNOWN.

gRPC's own deserializer failure surfaces as UNKNOWN; this interceptor swaps in a deserializer that marks the
request unparseable and a behaviour that aborts on the mark, for the unary and server-streaming methods (a streaming handler may yield its messages or write them with
``context.write``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

UNPARSEABLE = object()
MESSAGE = "the request is not a valid protobuf message of this method's request type"


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data) if deserializer is not None else data
        except DecodeError:
            return UNPARSEABLE

    return parse


class ParseGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.response_streaming:
            behavior = handler.unary_stream
            if not inspect.isasyncgenfunction(behavior):  # it writes with ``context.write``: no hop per message

                async def write(request, context):  # type: ignore[no-untyped-def]
                    if request is UNPARSEABLE:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE)
                    await behavior(request, context)

                return grpc.unary_stream_rpc_method_handler(write, _lenient(handler.request_deserializer),
                                                            handler.response_serializer)

            async def stream(request, context):  # type: ignore[no-untyped-def]
                if request is UNPARSEABLE:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE)
                async for item in behavior(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, _lenient(handler.request_deserializer),
                                                        handler.response_serializer)
        unary = handler.unary_unary

        async def call(request, context):  # type: ignore[no-untyped-def]
            if request is UNPARSEABLE:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(call, _lenient(handler.request_deserializer),
                                                   handler.response_serializer)
