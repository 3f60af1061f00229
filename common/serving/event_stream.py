"""How an HTTP client finds the end of a streamed (server-sent events) response of unknown length."""

from __future__ import annotations

from aiohttp import web


class EventStreamResponse(web.StreamResponse):
    """A streamed response whose head leaves with its first event, in one send (not one for each): aiohttp (3.11+)
    holds the head back until the first body write when ``_send_headers_immediately`` is False, as its
    ``web.Response`` does. An aiohttp without that switch sends the head at ``prepare``, as before.

    Invariant: nothing may be written into the transport past aiohttp's writer (``router.sse.SseSink``) until a write
    through the response went out, or it would precede the head."""

    _send_headers_immediately = False


def delimit_event_stream(resp: web.StreamResponse, request: web.Request) -> None:
    """Call before ``resp.prepare``. HTTP/1.1: chunked, as aiohttp would choose itself (``resp.chunked`` then says
    so, which lets a writer frame chunks itself); HTTP/1.0 has no chunks, so the connection's close ends the body.

    NOTE: aiohttp 3.14 keeps an HTTP/1.0 keep-alive connection open after a body of unknown length without saying
    so (no ``Connection: keep-alive``): such a client reads the whole stream and then waits for its end forever.
    """
    if request.version >= (1, 1):
        resp.enable_chunked_encoding()
    else:
        resp.force_close()
