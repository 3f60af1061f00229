"""``PrefillAdder``: each of its three budgets stops admission exactly at its boundary, for page sizes 1 and 16.

Each case admits requests in order the way ``PrefillManager.next_batch`` does (stop at the first result that
is not CONTINUE) and compares what was admitted (extend lengths), whether the last one became the chunked request,
and the result that stopped admission. Each boundary has a pair of cases one token apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.engine.req import Req
from common.engine.sampling.params import SamplingParams
from common.engine.schedule_policy import AddReqResult, PrefillAdder

BIG = 1 << 20
CONTINUE, NO_TOKEN, OTHER = AddReqResult.CONTINUE, AddReqResult.NO_TOKEN, AddReqResult.OTHER


class FreeSlots:
    """The allocator as the adder reads it: only its free slot count."""

    def __init__(self, free: int) -> None:
        self.free = free

    def available_size(self) -> int:
        return self.free


@dataclass(frozen=True)
class Case:
    page: int
    free: int  # KV slots free (rem_total_tokens' base)
    max_prefill: int  # rem_input_tokens' base
    chunk: int | None  # rem_chunk_tokens' base
    reqs: tuple[tuple[int, int], ...]  # (prompt tokens, max_new_tokens) in queue order
    admitted: tuple[int, ...]  # extend_input_len of each admitted request
    chunked: bool  # the last admitted request was truncated into the chunked request
    result: AddReqResult  # what stopped admission (CONTINUE: the queue ran out)


CASES = {
    # rem_total_tokens: prompt + max_new must stay below free - (extend + max_new + page) of those before, page-rounded
    "total-p1-fits": Case(1, 200, BIG, None, ((50, 49), (60, 39)), (50, 60), False, NO_TOKEN),
    "total-p1-over": Case(1, 200, BIG, None, ((50, 49), (60, 40), (1, 1)), (50,), False, NO_TOKEN),
    "total-p16-fits": Case(16, 320, BIG, None, ((50, 40), (100, 91)), (50, 100), False, NO_TOKEN),
    "total-p16-over": Case(16, 320, BIG, None, ((50, 40), (100, 92), (1, 1)), (50,), False, NO_TOKEN),
    # rem_input_tokens: page-rounded prompts up to --max-prefill-tokens; the first request always goes in
    "input-p1-fits": Case(1, BIG, 100, None, ((50, 8), (50, 8), (1, 1)), (50, 50), False, OTHER),
    "input-p1-over": Case(1, BIG, 100, None, ((50, 8), (51, 8), (1, 1)), (50,), False, OTHER),
    "input-p16-fits": Case(16, BIG, 128, None, ((50, 8), (64, 8), (1, 1)), (50, 64), False, OTHER),
    "input-p16-over": Case(16, BIG, 128, None, ((50, 8), (65, 8), (1, 1)), (50,), False, OTHER),
    "input-p16-first-alone": Case(16, BIG, 128, None, ((300, 8), (1, 1)), (300,), False, OTHER),
    # a queue that ends exactly at the budget: the last admission itself reports the budget spent
    "input-p1-exact": Case(1, BIG, 100, None, ((50, 8), (50, 8)), (50, 50), False, OTHER),
    # rem_chunk_tokens: what does not fit is cut to a page multiple of what is left and becomes the chunked request
    "chunk-p1-fits": Case(1, BIG, BIG, 100, ((50, 8), (50, 8), (1, 1)), (50, 50), False, OTHER),
    "chunk-p1-over": Case(1, BIG, BIG, 100, ((50, 8), (51, 8), (1, 1)), (50, 50), True, OTHER),
    "chunk-p16-fits": Case(16, BIG, BIG, 128, ((50, 8), (64, 8), (1, 1)), (50, 64), False, OTHER),
    "chunk-p16-over": Case(16, BIG, BIG, 128, ((50, 8), (65, 8), (1, 1)), (50, 64), True, OTHER),
    "chunk-p16-first-cut": Case(16, BIG, BIG, 128, ((300, 8), (1, 1)), (128,), True, OTHER),
    "chunk-p16-left-under-a-page": Case(16, BIG, BIG, 72, ((50, 8), (30, 8)), (50,), False, OTHER),
    "chunk-p1-exact": Case(1, BIG, BIG, 100, ((50, 8), (50, 8)), (50, 50), False, OTHER),
}


def admit(case: Case) -> tuple[tuple[int, ...], bool, AddReqResult]:
    adder = PrefillAdder(case.page, None, FreeSlots(case.free), [], 1.0, case.max_prefill, case.chunk)
    result = CONTINUE
    for i, (n, max_new) in enumerate(case.reqs):
        req = Req(f"r{i}", [10 + j % 900 for j in range(n)], SamplingParams(max_new_tokens=max_new))
        req.init_next_round_input(None)
        result = adder.add_one_req(req)
        if result != CONTINUE:
            break
    chunked = adder.new_chunked_req is not None and adder.new_chunked_req is adder.can_run_list[-1]
    return tuple(r.extend_input_len for r in adder.can_run_list), chunked, result


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_adder_budget_boundary(name: str) -> None:
    case = CASES[name]
    assert admit(case) == (case.admitted, case.chunked, case.result)


def test_running_requests_reserve_their_remaining_tokens_at_the_ratio() -> None:
    """rem_total_tokens starts at free - sum(page-rounded remaining max_new * ratio + page) of the running requests."""
    running = Req("run", list(range(10, 20)), SamplingParams(max_new_tokens=500))
    running.output_ids = [1] * 100  # 400 left
    for ratio, page, offset in ((0.5, 1, 201), (0.5, 16, 208 + 16), (1.0, 16, 400 + 16)):
        adder = PrefillAdder(page, None, FreeSlots(1000), [running], ratio, BIG, None)
        assert adder.rem_total_tokens == 1000 - offset, (ratio, page)
