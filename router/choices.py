"""``n > 1``: several choices of one OpenAI request, each served as its own request.

    client request (n) ──> choice_requests(req, n): choice i has rid ``<rid>-<i>``; a seeded request's choice i
                           samples with seed + i (reproducible, and the choices differ); an unseeded one draws each
                           choice from the nodes' shared generator
                      ──> each admitted and migrated like any request, and routed to the same workers and DP ranks
                          (one ``RoutePin``: the first routed choice's, while they can take the others), so that
                          - the prompt is prefilled once: on a prefill or colocated worker the others wait for it in
                            the radix cache, whatever the schedule policy (``common.engine.schedule_policy``)
                          - a decode worker receives and holds the prompt's full pages once: the others wait for the
                            first one's to land and share them (``decode_node.prealloc_queue``)
                          a retried or migrated choice goes where routing sends it (the pinned worker failed it)
                      ──> merge_choices: their events interleave as they arrive, tagged with the choice index

A choice that fails fails the whole request: the others are cancelled (their legs aborted on the workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from common.engine.sampling.params import for_choice
from router.request import GenRequest, RoutePin, sampling_to_proto


def choice_requests(req: GenRequest, n: int) -> list[GenRequest]:
    """The ``n`` choices of ``req`` (``req`` itself when ``n`` is 1), routed together (one ``RoutePin``)."""
    if n == 1:
        return [req]
    pinned = dataclasses.replace(req, pin=RoutePin())
    return [choice_request(pinned, i) for i in range(n)]


def pin_fits(pin: RoutePin, failed: set[str], workers: Sequence[Any], prefills: Sequence[Any] | None = None) -> bool:
    """Whether a choice can go where its request's first routed choice went: the same kind of plan (P/D or
    colocated), every pinned worker still a candidate (routable, with room), and none failed this choice."""
    if pin.worker is None or (pin.prefill is None) != (prefills is None):
        return False
    pinned = [(pin.worker, pin.rank, workers)] + ([(pin.prefill, pin.prefill_rank, prefills)] if prefills else [])
    return all(w.address not in failed and rank < len(w.ranks) and w in ws for w, rank, ws in pinned)


def choice_request(req: GenRequest, i: int) -> GenRequest:
    """Choice ``i`` of ``req``: its own rid and, for a seeded request, seed + i (wrapped to a signed 64-bit
    integer)."""
    sp = for_choice(req.sampling, i)
    return dataclasses.replace(req, rid=f"{req.rid}-{i}", sampling=sp, sampling_pb=sampling_to_proto(sp))


async def merge_choices(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """``(i, event)`` from every choice's event stream as they come. The first error raised by a stream is raised
    here once the other streams are cancelled; closing this generator closes every stream."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for ev in only:
                yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async with contextlib.aclosing(stream) as events:  # type: ignore[type-var]
                async for ev in events:
                    queue.put_nowait((i, ev, None))
        except Exception as e:  # the request fails with it
            queue.put_nowait((i, None, e))
        else:
            queue.put_nowait((i, done, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, ev, exc = await queue.get()  # bounded: each stream ends by its request's deadline
            if exc is not None:
                raise exc
            if ev is done:
                left -= 1
                continue
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
