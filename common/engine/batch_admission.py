"""Which requests the next batch holds: the scheduler's ``get_next_batch_to_run`` picks a new prefill batch, else the
running batch; this module forms both from the scheduler's queues.

    merge_last_batch        the last prefill batch joins the running batch; the chunked request stays out, cached
    get_new_batch_prefill   waiting queue -> ``PrefillAdder`` -> a prefill batch (mixed with the running batch's
                            decodes under ``--enable-mixed-chunk``), within --max-running-requests, free request
                            slots and the KV left after the running requests' reservation
    update_running_batch    the running batch, its finished requests filtered out, gets one more decode step's KV,
                            else the newest requests are retracted to the front of the waiting queue; under
                            speculative decoding the step verifies drafts when they are proposed and fit
    add_prebuilt            requests whose prompt KV and first token came from elsewhere join the running batch

``new_token_ratio``: the share of a running request's remaining ``max_new_tokens`` that admission keeps KV for.
It starts at ``INIT_NEW_TOKEN_RATIO * --schedule-conservativeness`` (at most 1), drops by its decay on every decode
step that fits down to its floor, and jumps to the estimate ``ScheduleBatch.retract_decode`` returns on a retraction.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from common.engine.req import Req
from common.engine.schedule_batch import ScheduleBatch
from common.engine.schedule_policy import AddReqResult, PrefillAdder
from common.engine.scheduler_metrics import MetricsSource, log_prefill_stats

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.scheduler_output import OutputCollector
    from common.engine.scheduler_role import SchedulerRole
    from common.engine.spec.speculator import Speculator

# NOTE: the scheduler's log lines keep its logger's name, which operators and tests filter on.
logger = logging.getLogger("common.engine.scheduler")

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


def new_token_ratio_schedule(schedule_conservativeness: float) -> tuple[float, float, float]:
    """(initial ``new_token_ratio``, its floor, its decay per decode step) for ``--schedule-conservativeness``."""
    init = min(1.0, INIT_NEW_TOKEN_RATIO * schedule_conservativeness)
    floor = init * MIN_NEW_TOKEN_RATIO_FACTOR
    return init, floor, (init - floor) / NEW_TOKEN_RATIO_DECAY_STEPS


class AdmissionState(MetricsSource, Protocol):
    """What batch admission reads and moves of the scheduler (``common.engine.scheduler.Scheduler``)."""

    args: ServerArgs
    out: OutputCollector
    last_batch: ScheduleBatch | None
    new_token_ratio: float
    min_new_token_ratio: float
    new_token_ratio_decay: float
    num_retracted: int
    preempted: list[Req]
    in_flight: object | None
    yield_to_role: bool
    speculator: Speculator | None

    @property
    def role(self) -> SchedulerRole: ...

    def new_batch(self, reqs: list[Req]) -> ScheduleBatch: ...

    def reclaim_deferred_pages(self) -> bool: ...

    def fail_req(self, req: Req, exc: Exception) -> None: ...

    def finish_req(self, req: Req, release: bool = True) -> None: ...


def merge_last_batch(sched: AdmissionState) -> None:
    """Fold the last prefill batch into the running batch; the chunked request stays out and is cached.

    NOTE: a request of an overlapped batch whose pending token ends it (a prefill node's, capped at one token)
    is left out by ``filter_batch`` although its result is not processed yet.
    """
    last, sched.last_batch = sched.last_batch, None
    if last is None or not last.forward_mode.is_extend():
        return
    if sched.chunked_req is not None:
        sched.tree_cache.cache_unfinished_req(sched.chunked_req)
        sched.role.on_chunk_done(sched.chunked_req)
    last.filter_batch(exclude=sched.chunked_req)
    if not last.is_empty():
        sched.running_batch.merge_batch(last)
        sched.running_batch.batch_is_full = False


def get_new_batch_prefill(sched: AdmissionState) -> ScheduleBatch | None:
    args = sched.args
    hicache = args.enable_hierarchical_cache
    if hicache:
        sched.tree_cache.check_hicache_events()
    if sched.yield_to_role:  # the slot and pages a role's preemption freed are its head's at the next poll
        sched.yield_to_role = False
        if sched.chunked_req is None:
            return None
    if sched.running_batch.is_empty():
        sched.running_batch.batch_is_full = False  # nothing holds memory for decode; always try the queue
    sched.policy.prepare(sched.waiting_queue, sched.running_batch, sched.new_token_ratio)
    if (sched.running_batch.batch_is_full or not sched.waiting_queue) and sched.chunked_req is None:
        return None
    running_bs = len(sched.running_batch.reqs)
    if running_bs >= args.max_running_requests and sched.chunked_req is None:
        sched.running_batch.batch_is_full = True
        return None
    mixed = args.enable_mixed_chunk and not sched.running_batch.is_empty()
    adder = PrefillAdder(
        sched.page_size,
        sched.tree_cache,
        sched.allocator,
        sched.running_batch.reqs,
        sched.new_token_ratio,
        args.max_prefill_tokens,
        args.chunk_size,
        running_bs if mixed else 0,
    )
    if sched.chunked_req is not None:
        sched.chunked_req.init_next_round_input(None)
        sched.chunked_req = adder.add_chunked_req(sched.chunked_req)
    # Request slots held outside the running batch (a prefill node's inflight queue, a decode node's transfer
    # queue) bound admission too: a request without a slot is admitted only while a free one is left.
    free_slots = sched.req_to_token_pool.available_size()
    for req in sched.waiting_queue:
        if running_bs + len(adder.can_run_list) >= args.max_running_requests or (
            req.req_pool_idx is None and free_slots <= 0
        ):
            sched.running_batch.batch_is_full = True
            break
        req.init_next_round_input(sched.tree_cache)
        if hicache and sched.tree_cache.init_load_back(req, adder.load_quota(req)):
            continue  # its prefix is coming back from the host or storage tier: it waits in the queue
        needs_slot = req.req_pool_idx is None
        result = adder.add_one_req(req)
        if needs_slot and adder.can_run_list and adder.can_run_list[-1] is req:
            free_slots -= 1
        if result != AddReqResult.CONTINUE:
            if result == AddReqResult.NO_TOKEN:
                sched.running_batch.batch_is_full = True
            break
    if not adder.can_run_list:
        return None
    admitted = {id(r) for r in adder.can_run_list}
    sched.waiting_queue = [r for r in sched.waiting_queue if id(r) not in admitted]
    if adder.new_chunked_req is not None:
        sched.chunked_req = adder.new_chunked_req
    if sched.chunked_req is not None:
        sched.chunked_req.is_chunked += 1
    now = time.monotonic()
    for req in adder.can_run_list:
        if not req.times.forward_start:
            req.times.forward_start = now
            req.cached_tokens = len(req.prefix_indices)
            if hicache:
                sched.tree_cache.stats.hit(req.cached_tokens, req.cached_tokens_host, req.cached_tokens_storage)
    batch = sched.new_batch(adder.can_run_list)
    batch.prepare_for_extend()
    batch.chunked_req = sched.chunked_req
    log_prefill_stats(sched, adder, running_bs)
    if mixed and not batch.return_logprob and not sched.running_batch.return_logprob:
        sched.running_batch.filter_batch()
        if not sched.running_batch.is_empty() and sched.running_batch.check_decode_mem():
            batch.mix_with_running(sched.running_batch)
            sched.running_batch = sched.new_batch([])
    return batch


def update_running_batch(sched: AdmissionState, batch: ScheduleBatch) -> None:
    batch.filter_batch()
    if batch.is_empty():
        return
    if not batch.check_decode_mem() and not (sched.reclaim_deferred_pages() and batch.check_decode_mem()):
        retracted, sched.new_token_ratio = batch.retract_decode()
        sched.num_retracted += len(retracted)
        sched.decode_log.retracted += len(retracted)
        logger.info(
            "KV cache is full: retracted %d requests, #running-req: %d, new_token_ratio: %.4f",
            len(retracted), len(batch.reqs), sched.new_token_ratio,
        )
        sched.waiting_queue[:0] = retracted
        batch.batch_is_full = False
    else:
        sched.new_token_ratio = max(sched.new_token_ratio - sched.new_token_ratio_decay, sched.min_new_token_ratio)
    if sched.speculator is None or not sched.speculator.prepare(batch):  # draft -> TARGET_VERIFY, else decode
        batch.prepare_for_decode()


def preempt_running(sched: AdmissionState, victims: list[Req], head: Req) -> None:
    """Priority preemption asked by a role's queue (a decode node's prealloc queue for its most urgent request):
    ``victims`` leave the running batch with their KV released, to be recomputed from the waiting queue.

    NOTE: pages freed while a batch is in flight are deferred (that batch may still write the victims' next slots,
    and the role hands freed pages to another process's writer). The victims join the waiting queue only at the
    next step, after the in-flight batch's result was processed: re-admitted in this step, the token of theirs
    still in flight would be taken as the output of a request no longer retracted. No prefill runs in this step
    (``yield_to_role``): requests retracted earlier would take the freed slot before the head's next poll.
    """
    with sched.allocator.defer_frees() if sched.in_flight is not None else contextlib.nullcontext():
        sched.policy.retract(sched.running_batch, victims, head)
    sched.preempted.extend(victims)
    sched.yield_to_role = True


def add_prebuilt(sched: AdmissionState, reqs: list[Req], take_first_token: Callable[[Req], None]) -> None:
    """Requests whose prompt KV and first token were computed elsewhere (a decode node's transfers): each
    gets its first token from ``take_first_token``, then joins the running batch or finishes at once."""
    running = []
    for req in reqs:
        try:
            take_first_token(req)
        except Exception as e:  # this request fails with INTERNAL and frees its pages; the rank carries on
            sched.fail_req(req, e)
            continue
        if req.finished():
            sched.finish_req(req)
        else:
            sched.out.stream_token(req)
            running.append(req)
    if running:
        sched.running_batch.merge_batch(sched.new_batch(running))
