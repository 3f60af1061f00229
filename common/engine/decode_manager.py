"""``DecodeManager``: the running batch of a rank and its next decode step (SGLang's ``running_batch``,
``last_batch`` and ``update_running_batch``; mini-sglang's decode manager). Requests it lets go of return to the
prefill manager (``common.engine.prefill_manager``), ahead of its queue.

    merge_last_batch   the last prefill batch joins the running batch; its chunked request stays out, cached
    next_batch         the running batch, its finished requests filtered out, gets one more decode step's KV, else
                       its newest requests are retracted to the front of the waiting queue; with a speculator the
                       step drafts and verifies (``Speculator.prepare``: TARGET_VERIFY) when drafts are proposed and
                       their KV fits, else it decodes one token
    add_prebuilt       requests whose prompt KV and first token came from elsewhere (a decode node's transfers) join
    preempt            a role's priority preemption: the victims leave, their KV released, to be recomputed
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from common.engine.req import Req
from common.engine.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.mem.allocator import TokenToKVPoolAllocator
    from common.engine.mem.req_to_token_pool import ReqToTokenPool
    from common.engine.prefill_manager import PrefillManager
    from common.engine.scheduler_metrics import RankMetrics
    from common.engine.spec.speculator import Speculator


class DecodeManager:
    def __init__(self, args: ServerArgs, tree_cache: Any, allocator: TokenToKVPoolAllocator,
                 req_to_token_pool: ReqToTokenPool, prefill: PrefillManager, speculator: Speculator | None,
                 metrics: RankMetrics, reclaim_deferred_pages: Callable[[], bool]) -> None:
        self.args = args
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.prefill = prefill
        self.speculator = speculator  # --speculative-algorithm's (None: off)
        self.metrics = metrics
        # Under KV pressure, before retracting: the pages deferred while the last launch is in flight, made
        # allocatable by waiting for it (``ModelWorker.reclaim_deferred_pages``); whether there were any.
        self.reclaim_deferred_pages = reclaim_deferred_pages
        self.running_batch = self.new_batch([])
        self.last_batch: ScheduleBatch | None = None  # the batch chosen by the last step (the loop sets it)
        self.num_retracted = 0

    def new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch.init_new(reqs, self.req_to_token_pool, self.allocator, self.tree_cache,
                                      self.args.speculative_algorithm)

    def is_idle(self) -> bool:
        return self.running_batch.is_empty() and self.last_batch is None

    def merge_last_batch(self) -> None:
        """Fold the last prefill batch into the running batch; the chunked request stays out and is cached.

        NOTE: a request of an overlapped batch whose pending token ends it (a prefill node's, capped at one token)
        is left out by ``filter_batch`` although its result is not processed yet.
        """
        last, self.last_batch = self.last_batch, None
        if last is None or not last.forward_mode.is_extend():
            return
        chunked = self.prefill.cache_chunked_req()
        last.filter_batch(exclude=chunked)
        if not last.is_empty():
            self.running_batch.merge_batch(last)
            self.running_batch.batch_is_full = False

    def next_batch(self) -> ScheduleBatch | None:
        """SGLang's ``update_running_batch``: the running batch prepared for its next step, or None when empty."""
        batch = self.running_batch
        batch.filter_batch()
        if batch.is_empty():
            return None
        if not batch.check_decode_mem() and not (self.reclaim_deferred_pages() and batch.check_decode_mem()):
            retracted, new_token_ratio = batch.retract_decode()
            self.num_retracted += len(retracted)
            self.metrics.log_retract(len(retracted), len(batch.reqs), new_token_ratio)
            self.prefill.requeue_retracted(retracted, new_token_ratio)
            batch.batch_is_full = False
        else:
            self.prefill.decay_new_token_ratio()
        if self.speculator is None or not self.speculator.prepare(batch):  # draft -> TARGET_VERIFY, else decode
            batch.prepare_for_decode()
        return batch

    def add_prebuilt(self, reqs: list[Req]) -> None:
        """Requests whose prompt KV and first token were computed elsewhere join the running batch."""
        if reqs:
            self.running_batch.merge_batch(self.new_batch(reqs))

    def preempt(self, victims: list[Req], head: Req) -> None:
        """Priority preemption asked by a role's queue (a decode node's prealloc queue for its most urgent request,
        ``head``): ``victims`` leave the running batch with their KV released, to be recomputed from the prefill
        manager's queue (``PrefillManager.add_preempted``)."""
        self.prefill.policy.retract(self.running_batch, victims, head)
        self.prefill.add_preempted(victims)
