"""``PrefillManager``: what waits to be prefilled on a rank, and the next prefill batch formed from it (SGLang's
``waiting_queue``, ``chunked_req``, ``new_token_ratio`` and ``get_new_batch_prefill``; mini-sglang's prefill
manager). The running batch is the decode manager's (``common.engine.decode_manager``); a prefill batch is formed
against it (its requests' reservations, its fullness) and, under ``--enable-mixed-chunk``, takes its decodes along.

    enqueue            a request joins the back of ``waiting_queue`` (a role's queue hands it over)
    requeue_retracted  requests retracted for KV rejoin at the front (the decode manager)
    add_preempted      a role's priority preemption: the victims wait in ``preempted`` and rejoin at the front at the
                       next step (``begin_step``); no prefill runs in this step (``yield_to_role``)
    next_batch         ``SchedulePolicy`` orders the queue (and may preempt for its most urgent request), then
                       ``PrefillAdder`` admits in order within --max-running-requests, free request slots and the KV
                       left after the running requests' reservation; a prompt longer than the round's chunk becomes
                       ``chunked_req``, continued first in the next round after ``cache_chunked_req``
    hierarchical cache a request whose prefix is coming back from the host or storage tier waits in the queue
                       (``HiRadixCache.init_load_back``); the cache's copy events are taken first in every round

``new_token_ratio``: the share of a running request's remaining ``max_new_tokens`` that admission keeps KV for.
It starts at ``INIT_NEW_TOKEN_RATIO * --schedule-conservativeness`` (at most 1), drops by its decay on every decode
step that fits down to its floor, and jumps to the estimate ``ScheduleBatch.retract_decode`` returns on a retraction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from common.engine.req import Req
from common.engine.schedule_batch import ScheduleBatch
from common.engine.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.mem.allocator import TokenToKVPoolAllocator
    from common.engine.mem.req_to_token_pool import ReqToTokenPool
    from common.engine.scheduler_metrics import RankMetrics

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


def new_token_ratio_schedule(schedule_conservativeness: float) -> tuple[float, float, float]:
    """(initial ``new_token_ratio``, its floor, its decay per decode step) for ``--schedule-conservativeness``."""
    init = min(1.0, INIT_NEW_TOKEN_RATIO * schedule_conservativeness)
    floor = init * MIN_NEW_TOKEN_RATIO_FACTOR
    return init, floor, (init - floor) / NEW_TOKEN_RATIO_DECAY_STEPS


class PrefillManager:
    def __init__(self, args: ServerArgs, tree_cache: Any, allocator: TokenToKVPoolAllocator,
                 req_to_token_pool: ReqToTokenPool, metrics: RankMetrics,
                 on_chunk_done: Callable[[Req], None]) -> None:
        self.args = args
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.metrics = metrics
        self.on_chunk_done = on_chunk_done  # the role's hook (``SchedulerRole.on_chunk_done``)
        self.policy = SchedulePolicy(args, tree_cache, allocator, req_to_token_pool)
        self.waiting_queue: list[Req] = []
        self.preempted: list[Req] = []  # retracted by a role's queue; waiting from the next step (add_preempted)
        self.chunked_req: Req | None = None
        self.yield_to_role = False  # a role's queue preempted this step: no prefill takes what it freed
        ratio = new_token_ratio_schedule(args.schedule_conservativeness)
        self.init_new_token_ratio, self.min_new_token_ratio, self.new_token_ratio_decay = ratio
        self.new_token_ratio = self.init_new_token_ratio

    # -- the queue ---------------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Requests preempted in the last step wait from now, ahead of the queue."""
        self.waiting_queue[:0], self.preempted = self.preempted, []

    def is_idle(self) -> bool:
        return not self.waiting_queue and not self.preempted and self.chunked_req is None

    def enqueue(self, reqs: list[Req]) -> None:
        """Requests join the back of the waiting queue (they are prefilled in turn)."""
        self.waiting_queue.extend(reqs)

    def take_waiting(self, leaves: Callable[[Req], bool]) -> list[Req]:
        """Remove and return the waiting requests for which ``leaves`` is true, in queue order."""
        gone = [r for r in self.waiting_queue if leaves(r)]
        for req in gone:
            self.waiting_queue.remove(req)
        return gone

    def remove(self, req: Req) -> bool:
        """Take ``req`` out if it waits (in the queue or preempted); whether it did."""
        queue = self.preempted if req in self.preempted else self.waiting_queue
        if req in queue:
            queue.remove(req)
            return True
        return False

    def num_waiting(self) -> int:
        """Requests in the waiting queue (on a decode node: retracted ones, which go before new admissions)."""
        return len(self.waiting_queue) + len(self.preempted)

    def prefilling_reqs(self) -> list[Req]:
        """Requests whose prompt is not computed yet: the waiting queue, then the chunked request."""
        return [*self.preempted, *self.waiting_queue, *([self.chunked_req] if self.chunked_req is not None else [])]

    # -- what the running batch hands back ----------------------------------------------------------------------------
    def requeue_retracted(self, reqs: list[Req], new_token_ratio: float) -> None:
        """Requests retracted for KV rejoin at the front; admission reserves at the ratio the retraction estimated."""
        self.waiting_queue[:0] = reqs
        self.new_token_ratio = new_token_ratio

    def decay_new_token_ratio(self) -> None:
        """A decode step fitted: admission reserves a little less for the running requests."""
        self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)

    def add_preempted(self, victims: list[Req]) -> None:
        """A role's priority preemption (``DecodeManager.preempt``): the victims wait from the next step, after the
        in-flight batch's result was processed (re-admitted in this step, a token of theirs still in flight would
        be taken as the output of a request no longer retracted). No prefill runs in this step: requests retracted
        earlier would take the freed slot before the preempting request's next poll."""
        self.preempted.extend(victims)
        self.yield_to_role = True

    def cache_chunked_req(self) -> Req | None:
        """The last prefill batch ran: the chunked request's pages computed so far go to the prefix cache (which may
        replace its slots by the cache's copies), then to the role, before its next chunk. It is returned (it stays
        out of the running batch)."""
        req = self.chunked_req
        if req is not None:
            self.tree_cache.cache_unfinished_req(req)
            self.on_chunk_done(req)
        return req

    def drop_chunked(self, req: Req) -> None:
        """``req`` stopped between chunks (aborted, failed): no further chunk of it."""
        if self.chunked_req is req:
            self.chunked_req = None

    # -- the next prefill batch ----------------------------------------------------------------------------------------
    def next_batch(self, running: ScheduleBatch) -> ScheduleBatch | None:
        """SGLang's ``get_new_batch_prefill``: the next prefill batch (mixed with ``running``'s decodes under
        --enable-mixed-chunk, which leaves ``running`` empty until the batch merges back), or None."""
        args = self.args
        hicache = args.enable_hierarchical_cache
        if hicache:
            self.tree_cache.check_hicache_events()
        if self.yield_to_role:  # the slot and pages a role's preemption freed are its head's at the next poll
            self.yield_to_role = False
            if self.chunked_req is None:
                return None
        if running.is_empty():
            running.batch_is_full = False  # nothing holds memory for decode; always try the queue
        self.policy.prepare(self.waiting_queue, running, self.new_token_ratio)
        if (running.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            return None
        running_bs = len(running.reqs)
        if running_bs >= args.max_running_requests and self.chunked_req is None:
            running.batch_is_full = True
            return None
        mixed = args.enable_mixed_chunk and not running.is_empty()
        adder = PrefillAdder(args.page_size, self.tree_cache, self.allocator, running.reqs, self.new_token_ratio,
                             args.max_prefill_tokens, args.chunk_size, running_bs if mixed else 0)
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input(None)
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        # Request slots held outside the running batch (a prefill node's inflight queue, a decode node's transfer
        # queue) bound admission too: a request without a slot is admitted only while a free one is left.
        free_slots = self.req_to_token_pool.available_size()
        for req in self.waiting_queue:
            if running_bs + len(adder.can_run_list) >= args.max_running_requests or (
                req.req_pool_idx is None and free_slots <= 0
            ):
                running.batch_is_full = True
                break
            req.init_next_round_input(self.tree_cache)
            if hicache and self.tree_cache.init_load_back(req, adder.load_quota(req)):
                continue  # its prefix is coming back from the host or storage tier: it waits in the queue
            needs_slot = req.req_pool_idx is None
            result = adder.add_one_req(req)
            if needs_slot and adder.can_run_list and adder.can_run_list[-1] is req:
                free_slots -= 1
            if result != AddReqResult.CONTINUE:
                if result == AddReqResult.NO_TOKEN:
                    running.batch_is_full = True
                break
        if not adder.can_run_list:
            return None
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1
        now = time.monotonic()
        for req in adder.can_run_list:
            if not req.times.forward_start:
                req.times.forward_start = now
                req.cached_tokens = len(req.prefix_indices)
                if hicache:
                    self.tree_cache.stats.hit(req.cached_tokens, req.cached_tokens_host, req.cached_tokens_storage)
        batch = ScheduleBatch.init_new(adder.can_run_list, self.req_to_token_pool, self.allocator, self.tree_cache,
                                       args.speculative_algorithm)
        batch.prepare_for_extend()
        batch.chunked_req = self.chunked_req
        self.metrics.log_prefill(adder, running_bs, len(self.waiting_queue))
        if mixed and not batch.return_logprob and not running.return_logprob:
            running.filter_batch()
            if not running.is_empty() and running.check_decode_mem():
                batch.mix_with_running(running)
                running.filter_batch(keep=[])  # its requests ride in this batch and rejoin it at the next merge
        return batch
