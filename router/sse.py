"""The server-sent events of one streamed OpenAI response: ``DeltaEvents`` makes each delta's ``data:`` event, and
``SseSink`` writes them from a leg's message callback, so a streamed token does not wake the request's handler task
(``router/core.py``, ``MuxCall.sink``).

Invariants: a response's events go out in the order of its tokens, whichever of the two paths (the sink, or the
handler reading the request's event stream) wrote each; the sink takes a delta only while the handler waits with
nothing queued (``MuxCall._deliver``) and only after the handler wrote the response's head and first event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import msgspec
from aiohttp import web

from router import openai_protocol as oai
from router.request import Delta
from router.tool_calls import ToolPlan

_encode = msgspec.json.encode
_MARK = "\x00pdcluster-text\x00"
_MARK_JSON = _encode(_MARK)
_TAIL = b',"logprobs":null,"finish_reason":null}]}\n\n'
_CHAT_TAIL = b'},"logprobs":null,"finish_reason":null}]}\n\n'
DIRECT_WRITE_LIMIT = 0x10000  # transport bytes queued past which a delta takes StreamResponse.write (and its drain)


def sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class DeltaEvents:
    """The ``data:`` events of each choice's deltas (``/v1/completions`` or ``/v1/chat/completions`` chunks, with
    logprobs when asked). With a tool plan a tool call's text is held back until the output ends: ``texts`` and
    ``sent`` are each choice's output so far and how much of it went out as content."""

    def __init__(self, api: str, rid: str, model: str, created: int, n: int, want_lp: bool, plan: ToolPlan | None,
                 logprobs: oai.LogprobFormatter) -> None:
        self.chat = api == "chat"
        self.rid, self.model, self.created = rid, model, created
        self.want_lp, self.plan, self.logprobs = want_lp, plan, logprobs
        self.offsets = [0] * n  # text offsets of each choice (completions' logprobs)
        self.texts, self.sent = [""] * n, [0] * n
        # Without logprobs, choice i's event is heads[i] + the text as JSON + TAIL: the bytes ``sse`` makes of
        # the same chunk, built once (the text's key is last but for the two nulls).
        make = oai.chat_chunk if self.chat else oai.completion_chunk
        content: Any = {"content": _MARK} if self.chat else _MARK
        self.heads = [sse(make(rid, model, created, content, None, None, index=i)).split(_MARK_JSON)[0]
                      for i in range(n)]

    def of(self, i: int, ev: Delta) -> bytes | None:
        """Choice ``i``'s event for ``ev``; None when it has nothing to send."""
        lp = None
        if self.want_lp:
            lp = (
                self.logprobs.chat(ev.token_ids, ev.logprobs, ev.top_logprobs)
                if self.chat
                else self.logprobs.completion(ev.token_ids, ev.logprobs, ev.top_logprobs, self.offsets[i])
            )
        self.offsets[i] += len(ev.text)
        piece = ev.text
        if self.plan is not None:
            self.texts[i] += ev.text
            upto = max(self.sent[i], self.plan.holds_back(self.texts[i]))
            piece, self.sent[i] = self.texts[i][self.sent[i] : upto], upto
        if lp is None:
            if not piece:
                return None
            if self.chat:
                return self.heads[i] + _encode(piece) + _CHAT_TAIL
            return self.heads[i] + _encode(ev.text) + _TAIL
        if self.chat:
            return sse(oai.chat_chunk(self.rid, self.model, self.created, {"content": piece}, None, lp, index=i))
        return sse(oai.completion_chunk(self.rid, self.model, self.created, ev.text, None, lp, index=i))


class SseSink:
    """The ``DeltaSink`` (``router/request.py``) of a one-choice streamed response: writes a delta's event at once.

    A chunked response (``common.serving.event_stream``) whose transport has room takes the event as one HTTP chunk written
    straight into the transport: the bytes ``StreamResponse.write`` would send, without its four Python frames per
    token. Else ``StreamResponse.write``, a coroutine that suspends only to drain a full transport, is run here up
    to that point (the event is in the transport by then). A suspended write finishes in a task of its own, and the
    sink declines deltas until it has (they reach the handler, which writes them after it). A write that fails (the
    client went) cancels the handler, as the client's disconnect does.
    """

    def __init__(self, resp: web.StreamResponse, events: DeltaEvents, handler: asyncio.Task[Any],
                 transport: asyncio.Transport | None = None) -> None:
        self.resp, self.events, self.handler = resp, events, handler
        # NOTE: writes past aiohttp's writer are framed here, so only a response with chunked encoding on gets them.
        self.transport = transport if transport is not None and resp.chunked else None
        self.live = False  # set by the handler once the response's head and first event are written
        self._draining: asyncio.Task[None] | None = None

    def ready(self) -> bool:
        return self.live and self._draining is None

    def write(self, delta: Delta) -> None:
        data = self.events.of(0, delta)
        if data is None:
            return
        t = self.transport
        if t is not None and t.get_write_buffer_size() < DIRECT_WRITE_LIMIT and not t.is_closing():
            t.write(b"%x\r\n%b\r\n" % (len(data), data))
            return
        coro = self.resp.write(data)
        try:
            waiting = coro.send(None)
        except StopIteration:
            return
        except Exception:  # the transport is closing: the client went
            self._fail()
            return
        self._draining = asyncio.get_running_loop().create_task(_finish(coro, waiting))
        self._draining.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task[None]) -> None:
        self._draining = None
        if task.cancelled() or task.exception() is not None:
            self._fail()

    def _fail(self) -> None:
        self.live = False
        self.handler.cancel()


async def _finish(coro: Coroutine[Any, Any, None], waiting: Any) -> None:
    """Run ``coro``, suspended outside any task on ``waiting`` (a future, or None for a bare yield), to its end, as
    the task running it would have."""
    try:
        while True:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait((waiting,))
            waiting = coro.send(None)
    except StopIteration:
        return
    finally:
        coro.close()
