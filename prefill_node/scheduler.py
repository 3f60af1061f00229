"""``PrefillScheduler``: one prefill rank. Holds the engine's ``Scheduler``, the KV manager and its two queues.

Two loops: the normal one below, and (default) an overlap loop that runs each prefill forward on a worker thread
while the scheduler thread handles the previous batch's results and the queues (``--disable-overlap-schedule``).

    step: receive -> pop bootstrapped into the waiting queue -> fold the last batch (send the chunked request's
          cached pages) -> pick and run a prefill batch -> send finished prompts' last pages + metadata ->
          poll the inflight queue (release KV, report PrefillDone)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from common.config import ServerArgs
from common.distributed import TPGroup
from common.errors import KV_PEER_FAULT, ErrorCode
from common.faults import inject
from common.io_struct import GenerateReqInput, PrefillDone, QueueLoad, SchedulerInput, Timing
from common.mem.pages import bytes_per_page, num_pages, req_pages
from common.model_runner import BatchResult
from common.req import Req
from common.schedule_batch import ScheduleBatch
from common.scheduler import Scheduler, internal_error_message
from common.scheduler_metrics import DisaggQueueCounts
from kvtransfer.metadata import MAX_TOP_LOGPROBS, MetadataRecord
from kvtransfer.node import make_kv_manager
from kvtransfer.poll import GroupPolls, KVPoll
from prefill_node.bootstrap_queue import PrefillBootstrapQueue
from prefill_node.inflight_queue import PrefillInflightQueue

logger = logging.getLogger(__name__)


class PrefillScheduler:
    def __init__(
        self, args: ServerArgs, model_path: str, tokenizer: Any, send_outputs: Callable[[list[Any]], None],
        dp_rank: int = 0,
        tp: TPGroup | None = None,
    ) -> None:
        self.args = args
        self.sched = Scheduler(args, model_path, tokenizer, send_outputs, dp_rank, tp)
        self.page_size = args.page_size
        tp = self.sched.tp
        self.kv_manager = make_kv_manager(args, self.sched.runner, "prefill", dp_rank, tp_rank=tp.tp_rank,
                                          tp_size=tp.tp_size)
        self.polls = GroupPolls(tp.all_reduce_min, tp.tp_rank, tp.tp_size)
        self.bootstrap_queue = PrefillBootstrapQueue(self.sched, self.kv_manager, self.polls)
        self.inflight_queue = PrefillInflightQueue(self.polls)
        pool = self.sched.runner.kv_pool
        self.bytes_per_page = bytes_per_page(pool) * self.sched.model_config.num_kv_heads // pool.num_kv_heads
        self.executor = ThreadPoolExecutor(1, "prefill-forward") if self.sched.overlap else None
        self.in_flight: tuple[ScheduleBatch, Future[BatchResult]] | None = None
        self.sched.role = self

    def queue_counts(self) -> DisaggQueueCounts:
        return DisaggQueueCounts(bootstrap=len(self.bootstrap_queue), inflight=len(self.inflight_queue))

    @property
    def max_total_num_tokens(self) -> int:
        return self.sched.max_total_num_tokens

    # -- the loops -------------------------------------------------------------------------------------------------
    def step(self, msgs: list[SchedulerInput]) -> bool:
        self.polls.refresh(self.kv_handles())
        return self.step_overlap(msgs) if self.executor is not None else self.step_normal(msgs)

    def kv_handles(self) -> list[Any]:
        """Every transfer handle a step may act on, in queue order (identical on every TP rank)."""
        reqs = [*self.bootstrap_queue.queue, *self.sched.waiting_queue, *self.inflight_queue.queue]
        if self.sched.chunked_req is not None:
            reqs.append(self.sched.chunked_req)
        return [r.disagg_kv for r in reqs if r.disagg_kv is not None]

    def step_normal(self, msgs: list[SchedulerInput]) -> bool:
        self.take_inputs(msgs)
        self.sched.merge_last_batch()
        self.send_chunked_pages()
        batch = self.sched.get_next_batch_to_run()
        if batch is not None:
            self.process_batch_result(batch, self.sched.run_batch(batch))
        self.sched.last_batch = batch
        self.poll_inflight()
        self.sched.out.flush()
        return batch is not None

    def step_overlap(self, msgs: list[SchedulerInput]) -> bool:
        """Batch k runs on the forward thread while this thread processes batch k-1's results and the queues.

        NOTE: safe because a prefill batch never depends on the previous batch's sampled tokens (its requests
        finish after one token), forwards run one at a time in order, and memory is only allocated here after
        the previous forward finished; pages released meanwhile are reused no earlier than the next step.
        """
        prev = None
        if self.in_flight is not None:
            prev_batch, future = self.in_flight
            self.in_flight = None
            prev = (prev_batch, future.result())
            if self.sched.chunked_req is not None and self.sched.chunked_req in prev_batch.reqs:
                self.sched.tree_cache.cache_unfinished_req(self.sched.chunked_req)
                self.send_chunked_pages()
        batch = self.sched.get_new_batch_prefill()
        if batch is not None:
            assert self.executor is not None
            self.in_flight = (batch, self.executor.submit(self.sched.run_batch, batch))
        if prev is not None:
            self.process_batch_result(*prev)
        self.take_inputs(msgs)
        self.poll_inflight()
        self.sched.out.flush()
        return batch is not None or prev is not None

    def take_inputs(self, msgs: list[SchedulerInput]) -> None:
        self.sched.process_input_requests(msgs)
        ready, failed = self.bootstrap_queue.pop_bootstrapped()
        self.sched.waiting_queue.extend(ready)
        for req in failed:
            self.finish(req, release=False)
        self.drop_failed_waiting()

    def is_idle(self) -> bool:
        return (self.sched.is_idle() and self.in_flight is None and not self.bootstrap_queue.queue
                and not self.inflight_queue.queue)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        self.kv_manager.close()

    # -- the role's hooks (``SchedulerRole``; the engine's ``process_input_requests`` dispatches to them) --------
    def admit(self, msg: GenerateReqInput) -> None:
        self.bootstrap_queue.add(msg)

    def fill_load(self, load: QueueLoad) -> None:
        load.bootstrap, load.inflight = len(self.bootstrap_queue), len(self.inflight_queue)

    def abort(self, rid: str, reason: str) -> None:
        req = self.sched.reqs_by_rid.get(rid)
        if req is None:
            return
        req.disagg_kv.abort(reason)
        if self.bootstrap_queue.remove(req):
            self.finish(req, release=False)
        elif req in self.sched.waiting_queue:
            self.sched.waiting_queue.remove(req)
            self.finish(req, release=False)
        elif self.inflight_queue.find(rid) is None:
            req.to_abort = reason  # in a prefill batch: stops at its next chunk boundary

    def drop_failed_waiting(self) -> None:
        """Waiting requests whose decode side failed or went away leave before using any compute."""
        failed = [r for r in self.sched.waiting_queue if self.polls.poll(r.disagg_kv) == KVPoll.Failed]
        for req in failed:
            self.sched.waiting_queue.remove(req)
            self.finish(req, release=False)

    # -- sending ---------------------------------------------------------------------------------------------------
    def send_chunked_pages(self) -> None:
        """Send the chunked request's pages computed so far.

        NOTE: runs after ``cache_unfinished_req`` (in ``merge_last_batch``), which may replace the request's own
        slots by the radix tree's copies and free the originals; sending before it could read freed pages.
        """
        req = self.sched.chunked_req
        if req is None or req.req_pool_idx is None:
            return
        if req.to_abort is not None or self.polls.poll(req.disagg_kv) == KVPoll.Failed:
            return
        full_pages = req.kv_committed_len // self.page_size
        if full_pages > req.kv_pages_sent:
            pages = req_pages(self.sched.req_to_token_pool.req_to_token, req, req.kv_pages_sent,
                              full_pages * self.page_size, self.page_size)
            req.disagg_kv.send(pages)
            req.kv_pages_sent = full_pages

    def send_last_pages(self, req: Req) -> None:
        total = num_pages(len(req.origin_input_ids), self.page_size)
        pages = req_pages(self.sched.req_to_token_pool.req_to_token, req, req.kv_pages_sent,
                          len(req.origin_input_ids), self.page_size)
        top = req.output_top_logprobs[0][:MAX_TOP_LOGPROBS] if req.output_top_logprobs else []
        metadata = MetadataRecord(
            room=req.bootstrap_room,  # type: ignore[arg-type]
            first_token=req.output_ids[0],
            logprob=req.output_logprobs[0] if req.output_logprobs else 0.0,
            cached_tokens=req.cached_tokens,
            top_ids=tuple(t for t, _ in top),
            top_logprobs=tuple(lp for _, lp in top),
        )
        req.disagg_kv.send(pages, last=True, metadata=metadata)
        req.kv_pages_sent = total

    # -- results ---------------------------------------------------------------------------------------------------
    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        for i, req in enumerate(batch.reqs):
            if req.finished():
                continue
            if req.is_chunked > 0:
                req.is_chunked -= 1
                if req.to_abort is not None or self.polls.poll(req.disagg_kv) == KVPoll.Failed:
                    if self.sched.chunked_req is req:
                        self.sched.chunked_req = None
                    req.disagg_kv.abort(req.to_abort or "transfer failed")
                    req.abort(req.to_abort or self.polls.failure(req.disagg_kv),
                              ErrorCode.CANCELLED if req.to_abort else self.polls.failure_code(req.disagg_kv))
                    self.inflight_queue.add(req)  # released once quiesced
                continue
            try:
                self.sched.append_token(req, result, i)  # the first (and only) token; finishes the request
                if req.to_abort is not None:
                    req.disagg_kv.abort(req.to_abort)
                else:
                    self.send_last_pages(req)
            except Exception as e:  # this request fails with INTERNAL; its pages wait until no transfer reads them
                logger.exception("rid=%s room=%s: internal error; the request fails, the rank keeps serving",
                                 req.rid, req.bootstrap_room)
                req.finished_reason = None
                req.abort(internal_error_message(e), ErrorCode.INTERNAL)
                req.disagg_kv.abort(internal_error_message(e), ErrorCode.INTERNAL)
            self.inflight_queue.add(req)

    def poll_inflight(self) -> None:
        for req, state in self.inflight_queue.pop_done():
            req.times.transfer_done = time.monotonic()
            try:
                inject("transfer", req.rid)
            except Exception as e:
                logger.exception("rid=%s room=%s: internal error in the transfer callback", req.rid, req.bootstrap_room)
                req.finished_reason = None
                req.abort(internal_error_message(e), ErrorCode.INTERNAL)
                state = KVPoll.Failed
            if state == KVPoll.Failed and not req.to_abort and not _internal(req):
                logger.warning("rid=%s room=%s: KV transfer failed: %s", req.rid, req.bootstrap_room,
                               self.polls.failure(req.disagg_kv))
            self.finish(req, release=True, state=state)

    def finish(self, req: Req, release: bool, state: KVPoll = KVPoll.Failed) -> None:
        """Release the request's KV (into the radix cache, unlocked) and report the Prefill leg's outcome."""
        if release and req.req_pool_idx is not None:
            self.sched.tree_cache.cache_finished_req(req)
            self.sched.running_batch.batch_is_full = False
        self.sched.reqs_by_rid.pop(req.rid, None)
        error = code = None
        if _internal(req):
            assert req.finished_reason is not None
            error, code = req.finished_reason.message, ErrorCode.INTERNAL
        elif state != KVPoll.Success:
            error = req.to_abort or self.polls.failure(req.disagg_kv) or "prefill failed"
            code = ErrorCode.CANCELLED if req.to_abort else self.polls.failure_code(req.disagg_kv)
        sent_bytes = req.kv_pages_sent * self.bytes_per_page
        self.sched.log_request_end(req, "kv sent" if state == KVPoll.Success else f"failed ({error})")
        req.disagg_kv.clear()
        t = req.times
        self.sched.out.send_now([PrefillDone(
            rid=req.rid,
            prompt_tokens=len(req.origin_input_ids),
            cached_tokens=req.cached_tokens,
            error=error,
            error_code=code,
            error_origin=KV_PEER_FAULT if state != KVPoll.Success and not _internal(req) and not req.to_abort
            else None,
            timing=Timing(
                queue=max(0.0, (t.forward_start or t.queue_enter) - (t.bootstrapped or t.queue_enter)),
                bootstrap=max(0.0, (t.bootstrapped or t.queue_enter) - t.queue_enter),
                prefill=max(0.0, (t.first_token or t.forward_start) - t.forward_start) if t.forward_start else 0.0,
                transfer=max(0.0, t.transfer_done - (t.first_token or t.transfer_done)) if t.transfer_done else 0.0,
                transfer_bytes=sent_bytes if state == KVPoll.Success else 0,
                e2e=time.monotonic() - t.arrival,
            ),
        )])


def _internal(req: Req) -> bool:
    """The request failed on an internal error of this rank (reported as INTERNAL, whatever the transfer did)."""
    return req.finished_reason is not None and req.finished_reason.code == ErrorCode.INTERNAL
