"""Priority scheduling with preemption on a real scheduler, colocated and as a decode rank (its prealloc queue):
the urgent request runs first, victims are the least urgent and newest, a preempted request resumes with identical
output, and within the threshold nothing is preempted."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from common.engine.req import Req
from common.engine.sampling.params import SamplingParams
from tests.engine.scheduler_driver import PS, Driver, ResolvedReceiver
from tests.model_fixtures import make_tiny_model


@pytest.fixture(scope="module")
def llama() -> Path:
    return make_tiny_model("llama")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
def test_high_priority_preempts_a_running_low_one_with_identical_outputs(llama, overlap, seeded) -> None:
    rng = random.Random(9)
    low, high = [rng.randrange(10, 1000) for _ in range(30)], [rng.randrange(10, 1000) for _ in range(20)]
    sp: dict[str, Any] = {"max_new_tokens": 24}
    if seeded:
        sp.update(temperature=1.0, seed=7)
    flags = {"enable_priority_scheduling": True, "max_running_requests": 1,
             "disable_overlap_schedule": not overlap, "enable_overlap_schedule": overlap}
    alone = Driver(llama, **flags)
    try:
        alone.submit([("low", low)], priority=0, **sp)
        alone.run()
        alone.submit([("high", high)], priority=100, **sp)
        alone.run()
    finally:
        alone.close()
    d = Driver(llama, **flags)
    try:
        d.submit([("low", low)], priority=0, **sp)
        d.run(until=lambda: len(d.outs.get("low", [])) >= 5)
        d.submit([("high", high)], priority=100, **sp)
        d.run()
        assert d.scheduler.prefill.policy.num_preempted == 1
        assert d.done == ["high", "low"], "the urgent request did not run first"
        assert not d.errors
        assert d.outs == alone.outs
        load = d.scheduler.get_load()
        assert load.preemptions == 1 and load.queue_by_priority["waiting"] == {}
    finally:
        d.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_prealloc_head_preempts_running_low_ones_with_identical_outputs(llama, overlap) -> None:
    """P/D: a decode node's urgent request that does not fit its KV preempts running requests it beats (least urgent
    and newest first, as many as its prompt needs); they recompute later and end with the tokens of a run without
    the urgent one. The scheduler runs as a decode rank would: its prealloc queue is polled first in every step."""
    from types import SimpleNamespace

    from decode_node.prealloc_queue import DecodePreallocQueue
    from kvtransfer.poll import KVPoll

    rng = random.Random(5)
    lows = [(f"low{i}", [rng.randrange(10, 1000) for _ in range(40)]) for i in range(3)]
    flags = {"enable_priority_scheduling": True, "max_total_tokens": 320, "disable_radix_cache": True,
             "disable_overlap_schedule": not overlap, "enable_overlap_schedule": overlap}
    alone = Driver(llama, **flags)
    try:
        alone.submit(lows, priority=0, max_new_tokens=24)
        alone.run()
    finally:
        alone.close()
    d = Driver(llama, **flags)
    s = d.scheduler
    rules = s.prefill.policy
    queue = DecodePreallocQueue(s, SimpleNamespace(args=SimpleNamespace(num_metadata_slots=4)), 8,  # type: ignore[arg-type]
                                SimpleNamespace(poll=lambda kv: KVPoll.WaitingForInput), rules)  # type: ignore[arg-type]
    admitted: list[Req] = []

    def poll() -> None:  # the decode role's hook: the prealloc queue first in every step
        got, failed = queue.pop_preallocated(0)
        assert not failed
        for req in got:  # its KV would now arrive from the prefill node; this test only needs the admission
            admitted.append(req)
            s.tree_cache.cache_finished_req(req)
            req.req_pool_idx = None

    s.role.poll = poll  # type: ignore[method-assign]
    try:
        d.submit(lows, priority=0, max_new_tokens=24)
        d.run(until=lambda: all(len(d.outs.get(rid, [])) >= 4 for rid, _ in lows))
        running = len(s.decode.running_batch.reqs)
        budget = queue.allocatable_tokens(running + 1)
        assert queue.preempt_priority() == 10  # what the router is told: priority > 0 + the threshold preempts
        # short of the budget by more than the few tokens the running requests' shrinking reservation gives back
        # while the head waits, and by less than one victim's pages
        head = Req("urgent", [7] * (budget - PS + 12), SamplingParams(max_new_tokens=4), priority=100)
        head.disagg_kv = ResolvedReceiver()
        queue.queue.append(head)
        d.run(until=lambda: admitted == [head], max_steps=6)
        assert rules.num_preempted == 1, "one victim frees enough for the head"
        d.run()
        assert d.done[-1] == "low2", "the newest low request was the one preempted and recomputed"
        assert not d.errors and d.outs == alone.outs
        assert head.disagg_kv.pages is not None and len(head.disagg_kv.pages) == -(-len(head.origin_input_ids) // PS)
    finally:
        d.close()


def test_decode_prealloc_preempts_once_per_urgent_request_when_slot_bound(llama) -> None:
    """Request slots, not KV, are short: each urgent request retracts one running request, and the slot it frees is
    the urgent request's at the next poll (a request retracted earlier, waiting to recompute, does not take it)."""
    from types import SimpleNamespace

    from decode_node.prealloc_queue import DecodePreallocQueue
    from kvtransfer.poll import KVPoll

    rng = random.Random(6)
    lows = [(f"low{i}", [rng.randrange(10, 1000) for _ in range(40)]) for i in range(4)]
    d = Driver(llama, enable_priority_scheduling=True, disable_radix_cache=True, max_running_requests=4)
    s = d.scheduler
    queue = DecodePreallocQueue(s, SimpleNamespace(args=SimpleNamespace(num_metadata_slots=4)), 8,  # type: ignore[arg-type]
                                SimpleNamespace(poll=lambda kv: KVPoll.WaitingForInput), s.prefill.policy)  # type: ignore[arg-type]
    admitted: list[Req] = []
    s.role.poll = lambda: admitted.extend(queue.pop_preallocated(0)[0])  # type: ignore[method-assign]
    try:
        d.submit(lows, priority=0, max_new_tokens=40)
        d.run(until=lambda: all(len(d.outs.get(rid, [])) >= 4 for rid, _ in lows))
        for k in range(3):  # the first takes the one free slot; each later one needs a victim
            head = Req(f"urgent{k}", [7] * 16, SamplingParams(max_new_tokens=4), priority=100)
            head.disagg_kv = ResolvedReceiver()
            queue.queue.append(head)
            d.run(until=lambda head=head: head in admitted, max_steps=3)
        assert s.prefill.policy.num_preempted == 2
    finally:
        for req in admitted:  # the urgent requests' KV never arrives here: give their slots and pages back
            s.tree_cache.cache_finished_req(req)
            req.req_pool_idx = None
        d.run()
        d.close()


def test_decode_prealloc_does_not_preempt_within_the_threshold(llama) -> None:
    from types import SimpleNamespace

    from decode_node.prealloc_queue import DecodePreallocQueue
    from kvtransfer.poll import KVPoll

    d = Driver(llama, enable_priority_scheduling=True, max_total_tokens=320, disable_radix_cache=True)
    s = d.scheduler
    queue = DecodePreallocQueue(s, SimpleNamespace(args=SimpleNamespace(num_metadata_slots=4)), 8,  # type: ignore[arg-type]
                                SimpleNamespace(poll=lambda kv: KVPoll.WaitingForInput), s.prefill.policy)  # type: ignore[arg-type]
    try:
        d.submit([("low", [11] * 40)], priority=0, max_new_tokens=12)
        d.run(until=lambda: len(d.outs.get("low", [])) >= 3)
        head = Req("near", [7] * (queue.allocatable_tokens(2) - PS + 1), SamplingParams(), priority=10)
        head.disagg_kv = ResolvedReceiver()
        queue.queue.append(head)
        assert queue.pop_preallocated(0) == ([], []) and s.prefill.policy.num_preempted == 0 and not s.prefill.preempted
        assert queue.preempt_priority() == 10 and not head.priority > 10
        queue.queue.clear()
        d.run()
    finally:
        d.close()


def test_priority_within_the_threshold_does_not_preempt(llama) -> None:
    d = Driver(llama, enable_priority_scheduling=True, max_running_requests=1,
               priority_scheduling_preemption_threshold=10)
    try:
        d.submit([("low", [11] * 20)], priority=0, max_new_tokens=12)
        d.run(until=lambda: len(d.outs.get("low", [])) >= 3)
        d.submit([("high", [12] * 20)], priority=10, max_new_tokens=4)
        d.run()
        assert d.scheduler.prefill.policy.num_preempted == 0
        assert d.done == ["low", "high"]
    finally:
        d.close()


def test_priority_without_priority_scheduling_fails_the_request(llama) -> None:
    d = Driver(llama)
    try:
        d.submit([("r", [11] * 8)], priority=1, max_new_tokens=2)
        assert "--enable-priority-scheduling" in d.errors["r"]
    finally:
        d.close()
