"""Admission that never overcommits (issue 34): the router does not send a request to a decode worker whose last
load report says it cannot admit it, with one decode worker too; it holds the request (bounded by
``--admission-wait`` and the deadline) until a report gives room, then routes it. Held requests route in the decode
nodes' priority order (issue 31): most urgent first, FCFS within a priority, those without a priority last."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from pdcluster.v1 import worker_pb2
from router.fleet.facts import fleet_problem
from router.routing.hold import hold_order
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


async def _hold(f, client, priorities: list[int | None]) -> list[asyncio.Future]:  # type: ignore[no-untyped-def]
    """Send one request per priority (request i asks for 2 + i tokens), each held before the next is sent."""
    held = f.server.service.pipeline.planner.held
    tasks = []
    for i, priority in enumerate(priorities):
        extra = {} if priority is None else {"extra_body": {"priority": priority}}
        tasks.append(asyncio.ensure_future(
            client.completions.create(model="mock-model", prompt=f"request {i}", max_tokens=2 + i, **extra)))
        await eventually(lambda n=i + 1: len(held) == n)
    return tasks


@pytest.mark.parametrize("low_values_first", [False, True])
async def test_held_requests_take_freed_room_most_urgent_first(low_values_first: bool) -> None:
    # page_size 16: room for one request's prompt per load report (the lease reserves its page until the next one)
    decode = [{"admissible_tokens": 0, "schedule_low_priority_values_first": low_values_first}]
    async with fleet(prefill=1, decode=decode, admission_wait_s=30.0) as f:
        reg = f.server.service.registry
        await eventually(lambda: all(s.report is not None for w in reg if w.role == "decode" for s in w.ranks))
        assert reg.low_priority_values_first() is low_values_first
        client = f.openai()
        sent = [None, 1, 5, 9, 5]  # arrival order; none can be admitted yet
        tasks = await _hold(f, client, sent)
        assert _decodes_sent(f) == 0
        f.decode[0].cfg.admissible_tokens = 16
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        # (priority, max_tokens): request i asked for 2 + i tokens, so FCFS within priority 5 shows as 4 before 6
        got = [(r["priority"], r["max_new_tokens"]) for r in f.decode[0].received("decode")]
        if low_values_first:
            assert got == [(1, 3), (5, 4), (5, 6), (9, 5), (None, 2)]
        else:
            assert got == [(9, 5), (5, 4), (5, 6), (1, 3), (None, 2)]


def test_hold_order_is_the_nodes_priority_order_then_arrival() -> None:
    def order(low_first: bool) -> list[int | None]:
        reqs = [(None, 0.0), (1, 1.0), (5, 2.0), (9, 3.0), (5, 4.0)]
        keys = sorted((hold_order(p, t, low_first, i), p, t) for i, (p, t) in enumerate(reqs))
        return [(p, t) for _, p, t in keys]  # type: ignore[misc]

    assert order(False) == [(9, 3.0), (5, 2.0), (5, 4.0), (1, 1.0), (None, 0.0)]
    assert order(True) == [(1, 1.0), (5, 2.0), (5, 4.0), (9, 3.0), (None, 0.0)]


async def test_a_held_request_behind_a_more_urgent_one_still_gets_its_clear_errors() -> None:
    async with fleet(prefill=1, decode=[{"admissible_tokens": 0}], admission_wait_s=0.6) as f:
        reg = f.server.service.registry
        await eventually(lambda: all(s.report is not None for w in reg if w.role == "decode" for s in w.ranks))
        tasks = await _hold(f, f.openai(), [9, 1])
        for t in tasks:
            with pytest.raises(openai.RateLimitError) as e:
                await asyncio.wait_for(t, 10)
            assert "--admission-wait" in str(e.value) and int(e.value.response.headers["Retry-After"]) >= 1
        assert len(f.server.service.pipeline.planner.held) == 0 and _decodes_sent(f) == 0
    async with fleet(prefill=1, decode=[{"admissible_tokens": 0}], admission_wait_s=30.0,
                     request_timeout_s=0.8) as f:
        reg = f.server.service.registry
        await eventually(lambda: all(s.report is not None for w in reg if w.role == "decode" for s in w.ranks))
        tasks = await _hold(f, f.openai(), [9, 1])
        for t in tasks:
            with pytest.raises(openai.APIStatusError) as e:
                await asyncio.wait_for(t, 10)
            assert e.value.status_code == 504 and "request deadline exceeded while" in str(e.value)
        assert len(f.server.service.pipeline.planner.held) == 0 and _decodes_sent(f) == 0


def test_decode_workers_that_disagree_on_the_priority_order_are_refused() -> None:
    base = {"served_model_name": "m", "context_len": 2048, "page_size": 16, "vocab_size": 100}
    accepted = worker_pb2.ServerInfo(**base)
    assert fleet_problem(worker_pb2.ServerInfo(**base), [accepted]) == ""
    problem = fleet_problem(worker_pb2.ServerInfo(**base, schedule_low_priority_values_first=True), [accepted])
    assert "schedule_low_priority_values_first True (the fleet's: False)" in problem


@pytest.mark.parametrize("low_values_first", [False, True])
async def test_a_request_that_can_preempt_goes_to_a_full_decode_worker(low_values_first: bool) -> None:
    """A full decode node with priority scheduling reports the priority a request must beat to preempt there
    (``preempt_priority``): such a request is sent at once (the node's prealloc queue retracts for it); the others
    are held as before."""
    bound = 50
    urgent, calm = (10, 90) if low_values_first else (90, 10)
    decode = [{"admissible_tokens": 0, "preempt_priority": bound,
               "schedule_low_priority_values_first": low_values_first}]
    async with fleet(prefill=1, decode=decode, admission_wait_s=30.0) as f:
        reg = f.server.service.registry
        await eventually(lambda: all(s.report is not None for w in reg if w.role == "decode" for s in w.ranks))
        client = f.openai()
        held = [asyncio.ensure_future(client.completions.create(
            model="mock-model", prompt=f"held {i}", max_tokens=2, **extra))
            for i, extra in enumerate([{}, {"extra_body": {"priority": calm}}, {"extra_body": {"priority": bound}}])]
        await asyncio.sleep(0.6)
        assert _decodes_sent(f) == 0
        r = await asyncio.wait_for(client.completions.create(
            model="mock-model", prompt="urgent", max_tokens=3, extra_body={"priority": urgent}), 10)
        assert r.usage.completion_tokens == 3
        assert [d["priority"] for d in f.decode[0].received("decode")] == [urgent]
        assert not any(t.done() for t in held)
        f.decode[0].cfg.admissible_tokens = 4096
        await asyncio.wait_for(asyncio.gather(*held), 20)
