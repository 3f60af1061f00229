"""Admission that never overcommits (issue 34): the router does not send a request to a decode worker whose last
load report says it cannot admit it, with one decode worker too; it holds the request (bounded by
``--admission-wait`` and the deadline) until a report gives room, then routes it."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from router.testing import eventually, fleet


def _decodes_sent(f) -> int:  # type: ignore[no-untyped-def]
    return sum(len(w.received("decode")) for w in f.decode)


async def test_one_full_decode_worker_gets_nothing_until_it_reports_room() -> None:
    async with fleet(prefill=1, decode=[{"admissible_tokens": 0}], admission_wait_s=30.0) as f:
        reg = f.server.service.registry
        await eventually(lambda: all(s.report is not None for w in reg if w.role == "decode" for s in w.ranks))
        client = f.openai()
        task = asyncio.ensure_future(client.completions.create(model="mock-model", prompt="hi", max_tokens=3))
        await asyncio.sleep(0.6)  # a few load reports, each saying "no room"
        assert not task.done() and _decodes_sent(f) == 0 and not f.prefill[0].received("prefill")
        f.decode[0].cfg.admissible_tokens = 4096  # the pool drained: the next report admits it
        r = await asyncio.wait_for(task, 10)
        assert r.usage.completion_tokens == 3 and _decodes_sent(f) == 1


async def test_a_request_no_decode_worker_can_admit_gets_429_after_the_admission_wait() -> None:
    async with fleet(prefill=1, decode=[{"admissible_tokens": 0}, {"admissible_tokens": 0}],
                     admission_wait_s=0.5) as f:
        reg = f.server.service.registry
        await eventually(lambda: all(s.report is not None for w in reg if w.role == "decode" for s in w.ranks))
        client = f.openai()
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as e:
            await client.completions.create(model="mock-model", prompt="hi", max_tokens=3)
        assert 0.4 < time.monotonic() - t0 < 5
        assert "--admission-wait" in str(e.value) and int(e.value.response.headers["Retry-After"]) >= 1
        assert _decodes_sent(f) == 0 and not f.prefill[0].received("prefill")
