"""Which running request gives way (issue 54): priority preemption retracts the least urgent running request first
and, among equally urgent ones, the newest, on a colocated node (``SchedulePolicy.preempt``) and on a decode node
(``DecodePreallocQueue``); and a decode node's admission budget keeps back the longest remaining generation of one
running request, so a new request that would eat into it waits until that request is done."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from common.engine.req import Req
from common.engine.sampling.params import SamplingParams
from decode_node.prealloc_queue import DecodePreallocQueue
from kvtransfer.poll import KVPoll
from tests.engine.scheduler_driver import Driver, ResolvedReceiver
from tests.model_fixtures import make_tiny_model

# Arrival order a < b < c < d; priorities mixed. The least urgent are a and c (0), the newest of them c: a victim
# chosen by age alone would be d, by urgency alone (in running order) a.
RUNNING = (("a", 0), ("b", 5), ("c", 0), ("d", 5))


@pytest.fixture(scope="module")
def llama() -> Path:
    return make_tiny_model("llama")


def _start(d: Driver, max_new_tokens: int) -> None:
    for i, (rid, priority) in enumerate(RUNNING):
        d.submit([(rid, [11 + i] * 20)], priority=priority, max_new_tokens=max_new_tokens)
    d.run(until=lambda: all(len(d.outs.get(rid, [])) >= 2 for rid, _ in RUNNING))
    assert len(d.scheduler.decode.running_batch.reqs) == len(RUNNING)


def test_colocated_preemption_takes_the_least_urgent_then_the_newest(llama) -> None:
    d = Driver(llama, enable_priority_scheduling=True, max_running_requests=len(RUNNING))
    s = d.scheduler
    victims: list[str] = []
    retract = s.prefill.policy.retract

    def recording(batch: Any, chosen: list[Req], head: Req) -> None:
        victims.extend(v.rid for v in chosen)
        retract(batch, chosen, head)

    s.prefill.policy.retract = recording  # type: ignore[method-assign]
    try:
        _start(d, max_new_tokens=24)
        d.submit([("urgent", [7] * 20)], priority=100, max_new_tokens=4)  # a slot short: one victim
        d.run()
        assert victims == ["c"]
        assert not d.errors and sorted(d.done) == ["a", "b", "c", "d", "urgent"]
    finally:
        d.close()


def _decode_queue(d: Driver) -> tuple[DecodePreallocQueue, list[Req]]:
    """The scheduler as a decode rank: its prealloc queue polled first in every step; every KV transfer resolved."""
    s = d.scheduler
    queue = DecodePreallocQueue(s, SimpleNamespace(args=SimpleNamespace(num_metadata_slots=4)), 8,  # type: ignore[arg-type]
                                SimpleNamespace(poll=lambda kv: KVPoll.WaitingForInput), s.prefill.policy)  # type: ignore[arg-type]
    admitted: list[Req] = []
    s.role.poll = lambda: admitted.extend(queue.pop_preallocated(0)[0])  # type: ignore[method-assign]
    return queue, admitted


def _arrive(queue: DecodePreallocQueue, rid: str, prompt_len: int, priority: int | None = None) -> Req:
    req = Req(rid, [7] * prompt_len, SamplingParams(max_new_tokens=4), priority=priority)
    req.disagg_kv = ResolvedReceiver()
    queue.queue.append(req)
    return req


def _give_back(d: Driver, admitted: list[Req]) -> None:
    for req in admitted:  # their KV never arrives here: their slots and pages go back
        d.scheduler.tree_cache.cache_finished_req(req)
        req.req_pool_idx = None


def test_decode_preemption_takes_the_least_urgent_then_the_newest(llama) -> None:
    d = Driver(llama, enable_priority_scheduling=True, disable_radix_cache=True, max_running_requests=len(RUNNING))
    s = d.scheduler
    queue, admitted = _decode_queue(d)
    victims: list[str] = []
    preempt = s.preempt_running

    def recording(chosen: list[Req], head: Req) -> None:
        victims.extend(v.rid for v in chosen)
        preempt(chosen, head)

    s.preempt_running = recording  # type: ignore[method-assign]
    try:
        _start(d, max_new_tokens=40)
        for k in range(2):  # the first takes the one free slot; the second needs a victim
            head = _arrive(queue, f"urgent{k}", 16, priority=100)
            d.run(until=lambda head=head: head in admitted, max_steps=3)
        assert victims == ["c"]
    finally:
        _give_back(d, admitted)
        d.run()
        d.close()


def test_decode_admission_keeps_the_longest_remaining_generation_back(llama) -> None:
    """A request that fits the free pages less the per-request reservations, but not also less what the running
    request still has to generate, waits until that request is done."""
    d = Driver(llama, max_total_tokens=320, disable_radix_cache=True)
    queue, admitted = _decode_queue(d)
    try:
        d.submit([("long", [11] * 20)], max_new_tokens=160)
        d.run(until=lambda: len(d.outs.get("long", [])) >= 2)
        longest = 160 - len(d.outs["long"])
        budget = queue.allocatable_tokens(2)  # the long request and the newcomer
        # need = prompt + a page: within the budget with the reserve given back, short of it by half the reserve
        head = _arrive(queue, "new", budget + longest // 2 - d.scheduler.args.page_size)
        d.run(until=lambda: head in admitted or "long" in d.done)
        assert d.done == ["long"] and head not in admitted  # it waited for the long request ...
        d.run(until=lambda: head in admitted, max_steps=3)  # ... and then fit
        assert not d.errors
    finally:
        _give_back(d, admitted)
        d.run()
        d.close()
