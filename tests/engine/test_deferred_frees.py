"""Deferred KV frees under the overlap schedule: a page that batch k's results free while batch k+1 is in flight is
not handed out again before batch k+1's result has been obtained (batch k+1 may still write a finished request's next
KV slot into it; a one-sided writer in another process is not ordered after that write).

The scheduler-level test spies on the engine's allocator and scheduler: it tags every page freed while a batch's
results are processed with the batch then in flight, and checks each allocation against the results obtained so far.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
import torch

from common.engine.io_struct import GenerateReqInput
from common.engine.mem import TokenToKVPoolAllocator
from common.engine.schedule_batch import ScheduleBatch
from tests.engine.test_engine import greedy, make_prompts, overlap_flags
from tests.engine.test_overlap import run_together


def pages_of(slots: torch.Tensor, ps: int) -> set[int]:
    return set((slots // ps).tolist())


# -- the allocator ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ps", [1, 4])
def test_deferred_pages_are_neither_free_nor_allocatable_until_released(ps: int) -> None:
    a = TokenToKVPoolAllocator(num_pages=4, page_size=ps)
    x, y = a.alloc(2 * ps), a.alloc(2 * ps)
    assert x is not None and y is not None and a.num_free_pages == 0
    with a.defer_frees():
        a.free(x)
        with pytest.raises(RuntimeError, match="reentrant"), a.defer_frees():
            pass
    assert a.num_free_pages == 0 and a.available_size() == 0 and a.num_deferred_pages == 2
    assert a.alloc(ps) is None and a.alloc_extend([0], [1], [-1]) is None and a.alloc_decode([1], [-1]) is None
    with pytest.raises(RuntimeError, match="double free"):
        a.free(x)  # a deferred page is not allocated any more
    a.free(y)  # outside the block: allocatable at once
    assert a.num_free_pages == 2 and a.num_deferred_pages == 2
    z = a.alloc(2 * ps)
    assert z is not None and pages_of(z, ps) == pages_of(y, ps) and a.alloc(ps) is None
    a.release_deferred()
    assert a.num_free_pages == 2 and a.num_deferred_pages == 0
    w = a.alloc(2 * ps)
    assert w is not None and pages_of(w, ps) == pages_of(x, ps)
    a.free(w)
    a.free(z)
    assert a.num_free_pages == 4


def test_backup_and_clear_keep_deferred_pages_accounted() -> None:
    a = TokenToKVPoolAllocator(num_pages=3, page_size=2)
    x = a.alloc(4)
    assert x is not None
    with a.defer_frees():
        a.free(x)
    state = a.backup_state()
    a.release_deferred()
    assert a.alloc(6) is not None
    a.restore_state(state)
    assert a.num_free_pages == 1 and a.num_deferred_pages == 2
    a.release_deferred()
    assert a.num_free_pages == 3
    with a.defer_frees():
        a.free(a.alloc(2))  # type: ignore[arg-type]
    a.clear()
    assert a.num_free_pages == 3 and a.num_deferred_pages == 0


# -- the scheduler ---------------------------------------------------------------------------------------------------
class ReuseSpy:
    """Batches are numbered in launch order. A page freed while batch n is in flight (during another batch's result
    processing) owes batch n: handing it out before batch n's result has been obtained is a violation."""

    def __init__(self, sched: Any) -> None:
        self.launched = 0
        self.obtained = 0  # the newest batch whose result the scheduler has obtained
        self.in_flight_at_free: int | None = None
        self.owed: dict[int, int] = {}  # page -> batch whose result must come first
        self.violations: list[tuple[int, int, int]] = []  # (page, batch owed, newest result obtained)
        self.reused = 0
        alloc = sched.allocator
        launch, process, free, take = sched.worker.launch, sched.process_batch_result, alloc.free, alloc._take

        def spy_launch(batch: ScheduleBatch) -> Future[Any]:
            self.launched += 1
            n = self.launched
            future = launch(batch)
            result = future.result

            def spy_result(*args: Any, **kwargs: Any) -> Any:
                out = result(*args, **kwargs)
                self.obtained = max(self.obtained, n)
                return out

            future.result = spy_result  # type: ignore[method-assign]
            return future

        def spy_process(batch: ScheduleBatch, result: Any) -> None:
            self.in_flight_at_free = self.launched if sched.worker.in_flight is not None else None
            try:
                process(batch, result)
            finally:
                self.in_flight_at_free = None

        def spy_free(slots: torch.Tensor) -> None:
            free(slots)
            if self.in_flight_at_free is not None:
                for page in pages_of(slots, alloc.page_size):
                    self.owed[page] = self.in_flight_at_free

        def spy_take(n: int) -> torch.Tensor | None:
            pages = take(n)
            for page in [] if pages is None else pages.tolist():
                owed = self.owed.pop(page, None)
                if owed is None:
                    continue
                self.reused += 1
                if owed > self.obtained:
                    self.violations.append((page, owed, self.obtained))
            return pages

        sched.worker.launch, sched.process_batch_result = spy_launch, spy_process
        alloc.free, alloc._take = spy_free, spy_take


@pytest.mark.parametrize("disable_radix", [True, False])
def test_pages_freed_with_a_batch_in_flight_wait_for_its_result(engine_factory, model_path, disable_radix) -> None:
    # 16 pages of 16 slots for 12 requests of 40..110 prompt tokens: finished requests' pages are reused at once.
    engine = engine_factory(model_path, page_size=16, max_total_tokens=256, disable_radix_cache=disable_radix,
                            **overlap_flags(True))
    sched = engine.scheduler
    assert sched.overlap
    spy = ReuseSpy(sched)
    vocab = engine.model_config.vocab_size
    prompts = make_prompts(vocab, [40, 70, 110, 55, 90, 45, 100, 60, 80, 50, 65, 95], seed=3)
    lengths = [3, 9, 5, 14, 2, 11, 7, 4, 12, 6, 10, 8]
    outs = run_together(engine, prompts, [greedy(n) for n in lengths])
    assert [len(o.output_ids) for o in outs] == lengths
    assert spy.reused > 0, "no page freed with a batch in flight was reused: the test exercised nothing"
    assert not spy.violations, f"pages handed out before the batch in flight at their free completed: {spy.violations}"
    assert sched.allocator.num_deferred_pages == 0  # idle: every deferred page is back



def admit_together(sched: Any, n: int) -> None:
    """The scheduler sees the next ``n`` requests in one step (held back until all have arrived)."""
    held: list[Any] = []
    step = sched.step

    def spy_step(msgs: list[Any]) -> bool:
        held.extend(msgs)
        if sum(isinstance(m, GenerateReqInput) for m in held) < n:
            return step([])
        sched.step = step
        return step(held)

    sched.step = spy_step



def test_kv_pressure_reclaims_deferred_pages_before_retracting(engine_factory, model_path) -> None:
    # 400 one-token pages for 8 requests admitted together: their decodes outgrow the pool while some finish.
    engine = engine_factory(model_path, page_size=1, max_total_tokens=400, disable_radix_cache=True,
                            **overlap_flags(True))
    sched = engine.scheduler
    deferred_at_retract: list[int] = []
    reclaims: list[bool] = []
    retract, reclaim = ScheduleBatch.retract_decode, sched.decode.reclaim_deferred_pages

    def spy_retract(batch: ScheduleBatch) -> Any:
        deferred_at_retract.append(batch.allocator.num_deferred_pages)
        return retract(batch)

    def spy_reclaim() -> bool:
        reclaims.append(reclaim())
        return reclaims[-1]

    sched.decode.reclaim_deferred_pages = spy_reclaim
    admit_together(sched, 8)
    prompts = make_prompts(1000, [28, 56, 24, 36, 27, 51, 48, 50], seed=1)
    lengths = [30, 48, 40, 30, 40, 30, 30, 40]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ScheduleBatch, "retract_decode", spy_retract)
        outs = run_together(engine, prompts, [greedy(n) for n in lengths])
    assert [len(o.output_ids) for o in outs] == lengths
    assert not any(deferred_at_retract), f"retracted with deferred pages not reclaimed: {deferred_at_retract}"
    assert any(reclaims), "the KV budget was meant to run short while pages were deferred"
