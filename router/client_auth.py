"""The client API keys (``--api-key``, ``--api-key-file``, ``PDCLUSTER_API_KEY[_FILE]``): generation and model calls
need ``authorization: Bearer <key>`` (OpenAI HTTP header or gRPC metadata) with one of them or the admin token,
compared in constant time (every key is compared).

Open without it: health and liveness (probes), gRPC health and reflection. The admin surface has its own bearer
token (``router/admin.py``) and is not opened by an API key. No key leaves the client surface open.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from aiohttp import web

from router.admin import ADMIN_PATHS, ADMIN_PREFIXES, ADMIN_RPCS, bearer_ok

ROUTER_SERVICE = "/pdcluster.v1.Router/"
OPEN_PATHS = frozenset({"/health", "/liveness"})
MISSING = "missing API key: send 'Authorization: Bearer <key>' (the router's --api-key)"
WRONG = "incorrect API key: send 'Authorization: Bearer <key>' with the router's --api-key"


def accepted(header: str | None, secrets: tuple[str, ...]) -> bool:
    return sum(bearer_ok(header, s) for s in secrets) > 0  # no early exit: the time says nothing of which key


def refusal(header: str | None) -> str:
    return MISSING if not header else WRONG


def unauthenticated_body(message: str) -> dict[str, dict[str, str | None]]:
    """OpenAI's shape of a 401 (what the ``openai`` client turns into ``AuthenticationError``)."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses the client RPCs of ``pdcluster.v1.Router`` (Generate, ListModels) without one of ``secrets``."""

    def __init__(self, secrets: tuple[str, ...]) -> None:
        self._secrets = secrets

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        method = handler_call_details.method
        if not method.startswith(ROUTER_SERVICE) or method.rsplit("/", 1)[-1] in ADMIN_RPCS:
            return await continuation(handler_call_details)
        header = dict(handler_call_details.invocation_metadata or ()).get("authorization")
        header = header if isinstance(header, str) else None
        if accepted(header, self._secrets):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        message = refusal(header)

        async def refuse_unary(request, context):  # type: ignore[no-untyped-def]
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def refuse_stream(request, context):  # type: ignore[no-untyped-def]
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover  (an async generator, as the streaming handler must be)

        # NOTE: no deserializer: the request body of an unauthenticated call is never parsed.
        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse_stream, None, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(refuse_unary, None,
                                                   handler.response_serializer if handler else None)


def api_key_middleware(secrets: tuple[str, ...]) -> Callable:
    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        path = request.path
        if path in OPEN_PATHS or path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES):
            return await handler(request)
        header = request.headers.get("Authorization")
        if not accepted(header, secrets):
            return web.json_response(unauthenticated_body(refusal(header)), status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check
