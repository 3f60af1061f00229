"""A decode node's prealloc and transfer queues order by priority under --enable-priority-scheduling (arrival order
within a priority), and keep arrival order without it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from common.config import ServerArgs
from common.engine.priority import PriorityRules
from common.engine.req import Req
from common.engine.sampling.params import SamplingParams
from decode_node.prealloc_queue import DecodePreallocQueue
from decode_node.transfer_queue import DecodeTransferQueue
from kvtransfer.poll import KVPoll


def reqs(priorities: list[int]) -> list[Req]:
    return [Req(f"r{i}", [1, 2, 3], SamplingParams(), priority=p) for i, p in enumerate(priorities)]


def order(on: bool) -> Any:
    return PriorityRules(ServerArgs(enable_priority_scheduling=on)).order_key()


@pytest.mark.parametrize("on", [True, False])
def test_prealloc_queue_admits_most_urgent_first(on: bool) -> None:
    engine: Any = SimpleNamespace(prefill=SimpleNamespace(num_waiting=lambda: 0, prefilling_reqs=lambda: []),
                                  args=ServerArgs())
    polls: Any = SimpleNamespace(poll=lambda kv: KVPoll.Bootstrapping)  # nobody admissible: the order shows
    kv_manager: Any = SimpleNamespace(args=SimpleNamespace(num_metadata_slots=4))
    q = DecodePreallocQueue(engine, kv_manager, 16, polls, PriorityRules(ServerArgs(enable_priority_scheduling=on)))
    q.queue = reqs([0, 5, 1, 5])
    q.pop_preallocated(0)
    assert [r.rid for r in q.queue] == (["r1", "r3", "r2", "r0"] if on else ["r0", "r1", "r2", "r3"])


@pytest.mark.parametrize("on", [True, False])
def test_transfer_queue_orders_by_priority(on: bool) -> None:
    q = DecodeTransferQueue(SimpleNamespace(), order(on))  # type: ignore[arg-type]
    q.extend(reqs([0, 5]))
    q.extend(reqs([0, 3, 9]))
    assert [(r.rid, r.priority) for r in q.queue] == (
        [("r2", 9), ("r1", 5), ("r1", 3), ("r0", 0), ("r0", 0)] if on
        else [("r0", 0), ("r1", 5), ("r0", 0), ("r1", 3), ("r2", 9)])
