"""The SGLang HTTP worker port's guard (``--sglang-http-port``): SGLang's worker ``--api-key`` and the pre-auth
bounds of ``common/node/conn_budget.py``.

- The key: every path but ``/health*`` needs ``Authorization: Bearer <key>`` (SGLang's ``add_api_key_middleware``;
  ``sglang-router --api-key KEY`` sends it to its workers). A refused request's body is never read. No key: open,
  as SGLang's workers are (a warning at start).
- A connection counts as unauthenticated from its accept until its first request whose key matched (no key: its
  first whole request head); while it does, it holds a slot of a ``ConnectionBudget`` (per peer host and in all: at
  a bound an older unauthenticated connection is closed to make room) and is closed if it is still unauthenticated
  ``HELLO_DEADLINE_S`` after its accept.

Invariant: a connection's budget slot is released exactly once: on its first authenticated request, at its
deadline, or when it closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from common.node.conn_budget import HELLO_DEADLINE_S, ConnectionBudget, Slot, peer_host
from common.node.sglang_response import error_response
from common.wire.security import bearer_ok

logger = logging.getLogger(__name__)

OPEN_PREFIX = "/health"  # /health, /health_generate: probes, open as in SGLang
MISSING = "missing API key: send 'Authorization: Bearer <key>' (this node's --api-key-file or PDCLUSTER_API_KEY; sglang-router --api-key sends it)"
WRONG = "incorrect API key: send 'Authorization: Bearer <key>' with this node's --api-key-file or PDCLUSTER_API_KEY"


class HttpGuard:
    def __init__(self, api_key: str, budget: ConnectionBudget | None = None) -> None:
        self.api_key = api_key
        self.budget = budget or ConnectionBudget("the SGLang HTTP port (--sglang-http-port)")
        self._pending: dict[Any, tuple[Slot, asyncio.TimerHandle]] = {}  # transport -> (budget slot, deadline)

    def attach(self, server: web.Server) -> None:
        """Count ``server``'s connections (the runner's, after ``setup``)."""
        # NOTE: aiohttp offers no accept hook; its Server is told of each connection's start and end by the
        # connection's handler, so those two calls are wrapped on this one instance.
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: Any) -> None:
            made(handler, transport)
            slot = self.budget.admit(peer_host(transport.get_extra_info("peername")), transport.abort)
            timer = asyncio.get_running_loop().call_later(HELLO_DEADLINE_S, self._expire, transport)
            self._pending[transport] = (slot, timer)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self._settle(handler.transport)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    @property
    def unauthenticated(self) -> int:
        return len(self._pending)

    def _settle(self, transport: Any) -> None:
        entry = self._pending.pop(transport, None)
        if entry is not None:
            entry[1].cancel()
            self.budget.release(entry[0])

    def _expire(self, transport: Any) -> None:
        if transport in self._pending:
            self._settle(transport)
            transport.abort()

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        header = request.headers.get("Authorization")
        if self.api_key and not bearer_ok(header, self.api_key):
            if not request.path.startswith(OPEN_PREFIX):
                return error_response(401, WRONG if header else MISSING)
        else:
            self._settle(request.transport)
        return await handler(request)
