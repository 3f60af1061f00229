"""The router's admin surface: worker membership (``RegisterWorker``/``DeregisterWorker``/``ListWorkers``) and the
HTTP views of internals (``/v1/workers``, ``/metrics``, ``/v1/requests/{id}/timing``) need
``authorization: Bearer <admin token>`` (gRPC metadata or HTTP header), compared in constant time.

The admin token is ``--admin-token`` / ``PDCLUSTER_ADMIN_TOKEN``, else the cluster secret; with neither set, the
admin surface refuses every call. Generation, models and health stay open to clients.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from aiohttp import web

from common.wire.security import bearer_ok as bearer_ok  # re-exported: router modules import it from here

ADMIN_RPCS = frozenset({"RegisterWorker", "DeregisterWorker", "ListWorkers"})
ADMIN_PATHS = ("/v1/workers", "/metrics")
ADMIN_PREFIXES = ("/v1/requests/",)
REFUSED = "admin credential required: send 'authorization: Bearer <admin token>' (--admin-token or the cluster secret)"


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``token`` (what admin clients such as the Ray registrar send)."""
    return (("authorization", f"Bearer {token}"),)


class AdminInterceptor(grpc.aio.ServerInterceptor):
    """Refuses the admin RPCs of ``pdcluster.v1.Router`` without the admin bearer token (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        if handler_call_details.method.rsplit("/", 1)[-1] not in ADMIN_RPCS:
            return await continuation(handler_call_details)
        header = dict(handler_call_details.invocation_metadata or ()).get("authorization")
        if bearer_ok(header if isinstance(header, str) else None, self._token):
            return await continuation(handler_call_details)

        async def refuse(request, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

        return grpc.unary_unary_rpc_method_handler(refuse)


def admin_middleware(token: str) -> Callable:
    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        path = request.path
        if (path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES)) and not bearer_ok(
                request.headers.get("Authorization"), token):
            return web.json_response({"error": {"message": REFUSED, "type": "unauthorized", "code": 401}},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check
