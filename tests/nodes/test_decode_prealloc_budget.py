"""``DecodePreallocQueue.pop_preallocated``: a request gets its slot and pages only when its prompt fits the free KV
slots minus ``num_reserved_decode_tokens`` for every active request; retracted requests (back in the scheduler's
waiting queue) come back before any new one; nobody overtakes the head of the queue.

The queue runs on a real scheduler's pools; its KV manager, transfer polls and receivers are stand-ins that say every
prefill peer is resolved (WaitingForInput) and record the destination pages sent to them.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from common.config import ServerArgs
from common.engine.req import Req
from common.engine.sampling.params import SamplingParams
from common.engine.scheduler import Scheduler
from common.text.tokenizer import load_tokenizer
from decode_node.prealloc_queue import DecodePreallocQueue
from kvtransfer.poll import KVPoll
from tests.model_fixtures import make_tiny_model

PAGE = 16
RESERVED = 128


class ResolvedPeers:
    """``GroupPolls`` as the queue reads it: every prefill peer is resolved."""

    def poll(self, handle: Any) -> KVPoll:
        return KVPoll.WaitingForInput


class Receiver:
    """A ``KVReceiver`` stand-in: remembers the destination pages it was asked to announce."""

    def __init__(self) -> None:
        self.pages: list[int] | None = None

    def send_metadata(self, pages: list[int], metadata_slot: int) -> None:
        self.pages = pages


@pytest.fixture(scope="module")
def sched() -> Iterator[Scheduler]:
    model = str(make_tiny_model("llama"))
    args = ServerArgs(model_path=model, page_size=PAGE, max_total_tokens=1024, max_running_requests=16,
                      disable_radix_cache=True, disable_overlap_schedule=True)
    s = Scheduler(args, model, load_tokenizer(model), lambda msgs: None)
    yield s
    s.close()


@pytest.fixture
def queue(sched) -> Iterator[DecodePreallocQueue]:
    q = DecodePreallocQueue(sched, SimpleNamespace(args=SimpleNamespace(num_metadata_slots=8)), RESERVED,
                            ResolvedPeers())  # type: ignore[arg-type]
    q.made = []  # type: ignore[attr-defined]
    yield q
    sched.prefill.waiting_queue.clear()
    release(sched, [r for r in q.made if r.req_pool_idx is not None])  # type: ignore[attr-defined]
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
    assert sched.allocator.available_size() == sched.allocator.size


def request(queue: DecodePreallocQueue, rid: str, prompt_len: int) -> Req:
    req = Req(rid, [10 + j % 900 for j in range(prompt_len)], SamplingParams(max_new_tokens=8))
    req.disagg_kv = Receiver()
    queue.made.append(req)  # type: ignore[attr-defined]
    return req


def release(sched: Scheduler, reqs: list[Req]) -> None:
    """Give back what the queue allocated (the transfer queue's job once a request is done)."""
    for req in reqs:
        sched.tree_cache.cache_finished_req(req)
        req.req_pool_idx = None


@pytest.mark.parametrize("transferring", [0, 3])
@pytest.mark.parametrize("over", [0, 1], ids=["fits", "one-over"])
def test_prealloc_holds_a_request_over_the_budget_minus_reserved_tokens(sched, queue, transferring, over) -> None:
    free = sched.allocator.available_size()
    active = transferring + 1
    prompt = free - RESERVED * active - PAGE + over  # need = prompt + one page of decode headroom
    assert prompt + PAGE <= free, "the held request would fit the free slots without the reservation"
    req = request(queue, "r", prompt)
    queue.queue.append(req)
    admitted, failed = queue.pop_preallocated(transferring)
    assert failed == []
    if over:
        assert admitted == [] and queue.queue == [req], (
            f"a {prompt}-token prompt was admitted into {free} free slots with {active} x {RESERVED} reserved")
        assert req.req_pool_idx is None and req.disagg_kv.pages is None
        assert sched.allocator.available_size() == free
        queue.queue.clear()
    else:
        assert admitted == [req] and queue.queue == []
        assert req.disagg_kv.pages is not None and len(req.disagg_kv.pages) == -(-prompt // PAGE)
        assert sched.allocator.available_size() == free - len(req.disagg_kv.pages) * PAGE


def test_prealloc_counts_each_admitted_request_as_active(sched, queue) -> None:
    """The second request of one round is charged a reservation for the first as well, and stops the third."""
    free = sched.allocator.available_size()
    first = request(queue, "a", 64)
    second = request(queue, "b", free - 64 - 2 * RESERVED - PAGE + 1)  # fits with one reservation, not with two
    third = request(queue, "c", 16)
    queue.queue.extend([first, second, third])
    admitted, _ = queue.pop_preallocated(0)
    assert admitted == [first]
    assert queue.queue == [second, third], "a later request overtook the held head of the queue"
    queue.queue.clear()


def test_prealloc_waits_for_retracted_requests_to_come_back_first(sched, queue) -> None:
    retracted = request(queue, "retracted", 32)
    retracted.is_retracted = True
    sched.prefill.waiting_queue.append(retracted)  # a retracted decode request waits to be recomputed
    new = request(queue, "new", 32)
    queue.queue.append(new)
    admitted, failed = queue.pop_preallocated(0)
    assert admitted == [] and failed == [] and queue.queue == [new], (
        "a new request took KV memory while a retracted one was still waiting for it")
    sched.prefill.waiting_queue.clear()  # the retracted request is back in the running batch
    admitted, _ = queue.pop_preallocated(0)
    assert admitted == [new]


def test_the_decode_role_budgets_with_the_num_reserved_decode_tokens_flag() -> None:
    """--num-reserved-decode-tokens reaches the role's prealloc queue: an idle decode rank's admissible prompt tokens
    (its load report) drop by the flag's value for the one request they would admit."""
    from decode_node.role import DecodeRole

    model = str(make_tiny_model("llama"))
    admissible = {}
    for reserved in (0, 256):
        args = ServerArgs(model_path=model, page_size=PAGE, max_total_tokens=1024, max_running_requests=16,
                          disaggregation_mode="decode", disable_overlap_schedule=True,
                          num_reserved_decode_tokens=reserved)
        s = Scheduler(args, model, load_tokenizer(model), lambda msgs: None, role=DecodeRole(args))
        try:
            load = s.get_load()
            s.role.fill_load(load)
            admissible[reserved] = load.admissible_tokens
        finally:
            s.close()
    assert admissible[0] - admissible[256] == 256, admissible
