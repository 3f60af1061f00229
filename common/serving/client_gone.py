"""A client that leaves while its response is written has disconnected; the server did not fail.

aiohttp cancels a request's handler when the client's connection is lost (``handler_cancellation``), but it learns of
the loss one loop turn after the transport began closing. A handler that writes in that turn (a streamed response's
head, an event, its end) gets ``ClientConnectionResetError`` ("Cannot write to closing transport"), which aiohttp
logs at ERROR with a traceback, as if the server had a bug: 27 such tracebacks in a 10-minute soak with 1,143 client
cancels (benchmarks/soak.py). ``client_gone_middleware`` answers that case as aiohttp answers a disconnect it saw
first: the handler's ``async with`` blocks have already closed its streams (aborting the request on the workers),
and the response returned here is never sent (aiohttp finds the connection gone and only logs the access).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for it; no client ever reads it


@web.middleware
async def client_gone_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ConnectionResetError:
        transport = request.transport
        if transport is not None and not transport.is_closing():
            raise  # not this client's connection: a real error
        logger.debug("%s %s: the client left while its response was written", request.method, request.path)
        return web.Response(status=CLIENT_CLOSED_REQUEST)
