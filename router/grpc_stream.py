"""A streamed ``Router.Generate``'s writer: the request's events leave as gRPC messages, one write at a time.

    pipeline events ──pump task──┐
                                 ├──> queue ──> the RPC's task: what queued, as one message per run of one
    a leg's sink (one choice) ───┘              choice's deltas, then ``await context.write``; the Final last

The request's event stream runs in a task of its own (the pump), so the RPC's task only writes. With one choice the
writer is also the request's ``DeltaSink`` (``router/attempts/run.py``): a leg's sink hands it a delta from the
node's message callback, so a streamed token wakes the writer alone, not the pump and the generators between the
leg and the client. Deltas that queue while a write is in flight (tokens outrunning the writes) go out merged in one
``TextChunk`` (text joined, token ids and logprobs in order); when the writes keep up, each delta is its own message,
written as soon as it arrives.

Invariants: the messages carry the events in the order they were queued, and the sink queues a delta only while the
pump waits with nothing queued (``MuxCall._deliver``), behind every event the pump queued before it; an error of the
event stream is raised after the events queued before it were written; the pump ends (and the request's legs with
it) before the RPC's task does, whether the request ended, failed, or its client went.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdcluster.v1 import router_pb2
from router.request import Delta, Final

Event = tuple[int, Delta | Final]  # (choice index, event)


def chunk_message(index: int, deltas: list[Delta]) -> router_pb2.RouterGenerateResponse:
    """One ``TextChunk`` holding ``deltas`` (consecutive, of choice ``index``) in order."""
    m = router_pb2.RouterGenerateResponse()
    c = m.chunk
    if len(deltas) == 1:
        d = deltas[0]
        c.text = d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs:
            c.logprobs.extend(d.logprobs)
        if d.top_logprobs:
            c.top_logprobs.extend(d.top_logprobs)
        if not (d.text or d.token_ids):
            c.SetInParent()  # an empty chunk still selects ``chunk``
    else:
        c.text = "".join(d.text for d in deltas)
        for d in deltas:
            c.token_ids.extend(d.token_ids)
            if d.logprobs:
                c.logprobs.extend(d.logprobs)
            if d.top_logprobs:
                c.top_logprobs.extend(d.top_logprobs)
        c.SetInParent()
    if index:
        c.index = index
    return m


class GrpcStreamWriter:
    """Writes one streamed Generate's events to its client (``context``); ``final_message`` makes a Final's."""

    def __init__(self, context: Any, final_message: Callable[[Final, int], router_pb2.RouterGenerateResponse]) -> None:
        self.context = context
        self.final_message = final_message
        self._queue: list[Event] = []
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False  # the pump is done: everything it will queue is queued
        self._error: Exception | None = None  # what ended the event stream, raised after the queue is written
        self._open = True  # False once the writer stopped (the request ended, failed or its client went)

    # -- DeltaSink (router/request.py): a leg's sink hands it choice 0's deltas -------------------------------------
    def ready(self) -> bool:
        return self._open

    def write(self, delta: Delta) -> None:
        self._queue.append((0, delta))
        self._wake()

    # -- the RPC's task -----------------------------------------------------------------------------------------
    async def serve(self, events: AsyncIterator[Event]) -> None:
        """Write ``events`` (and what the sink queues) until the last, then raise the event stream's error if it
        had one. Cancelled (the client went, the RPC's deadline passed), it cancels the event stream and waits for
        it to end (its legs are aborted)."""
        loop = asyncio.get_running_loop()
        pump = loop.create_task(self._pump(events))
        try:
            while True:
                if not self._queue:
                    if self._ended:
                        break
                    self._waiter = loop.create_future()
                    await self._waiter  # bounded: the event stream ends by the request's deadline
                    self._waiter = None
                    continue
                batch, self._queue = self._queue, []
                if len(batch) == 1:
                    i, ev = batch[0]
                    await self.context.write(chunk_message(i, [ev]) if isinstance(ev, Delta)
                                             else self.final_message(ev, i))
                    continue
                for msg in self._messages(batch):
                    await self.context.write(msg)
        finally:
            self._open = False
            if not pump.done():
                pump.cancel()
                await asyncio.wait((pump,))  # bounded: a cancelled event stream closes its legs at once
        if self._error is not None:
            raise self._error
        if pump.cancelled():  # not by this writer (it was open): the request's task was cut, as the RPC's would be
            raise asyncio.CancelledError

    def _messages(self, batch: list[Event]) -> list[router_pb2.RouterGenerateResponse]:
        """``batch``'s messages: each run of one choice's deltas merged into one chunk."""
        out: list[router_pb2.RouterGenerateResponse] = []
        run: list[Delta] = []
        run_index = 0
        for i, ev in batch:
            if isinstance(ev, Delta) and (not run or i == run_index):
                run.append(ev)
                run_index = i
                continue
            if run:
                out.append(chunk_message(run_index, run))
                run = []
            if isinstance(ev, Delta):
                run, run_index = [ev], i
            else:
                out.append(self.final_message(ev, i))
        if run:
            out.append(chunk_message(run_index, run))
        return out

    async def _pump(self, events: AsyncIterator[Event]) -> None:
        try:
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for item in events:
                    self._queue.append(item)
                    self._wake()
        except Exception as e:  # the request failed: its client gets the error after what came before it
            self._error = e
        finally:
            self._ended = True
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
