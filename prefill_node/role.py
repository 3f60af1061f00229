"""``PrefillRole``: one prefill rank's role in the engine loop, handed to its ``Scheduler``. Holds the KV manager and
its two queues; ``Scheduler.step`` runs the loop and asks the hooks below (``SchedulerRole``), and the role calls
the scheduler back through the narrow ``Engine`` interface only.

Lifecycle of a request: bootstrap -> waiting -> (chunked) prefill -> inflight -> done (PrefillDone)::

    begin_step          snapshot every transfer the step acts on (one TP collective)
    admit               a new request waits in the bootstrap queue for its decode peer
    poll                bootstrapped -> waiting queue; failed peers leave; finished transfers release their pages
    on_chunk_done       the chunked request's computed pages are sent, once cached
    on_prefill_done     the prompt's last pages and the first token go to the decode node
    keep_pages_on_finish  a finished request waits in the inflight queue until no transfer reads its pages
    on_finish           the Prefill leg's outcome is reported (PrefillDone), not a token stream
"""

from __future__ import annotations

import logging
import time
from typing import Any

from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput, PrefillDone, QueueLoad, Timing
from common.engine.mem.pages import num_pages, req_pages
from common.engine.priority import PriorityRules
from common.engine.req import Finished, FinishReason, Req
from common.engine.scheduler_metrics import DisaggQueueCounts
from common.engine.scheduler_role import Engine
from common.errors import KV_PEER_FAULT, ErrorCode, internal_error_message
from common.faults import inject
from kvtransfer.metadata import MAX_TOP_LOGPROBS, MetadataRecord
from kvtransfer.node import rank_transfer
from kvtransfer.poll import KVPoll
from prefill_node.bootstrap_queue import PrefillBootstrapQueue
from prefill_node.inflight_queue import PrefillInflightQueue

logger = logging.getLogger(__name__)


class PrefillRole:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.page_size = args.page_size
        self.leaving: dict[int, KVPoll] = {}  # id(req) -> final transfer state, while poll finishes it

    def bind(self, engine: Engine) -> None:
        self.engine = engine
        self.kv = rank_transfer(self.args, engine.runner, "prefill", engine.dp_rank, engine.tp)
        self.kv_manager, self.polls, self.bytes_per_page = self.kv.manager, self.kv.polls, self.kv.bytes_per_page
        self.bootstrap_queue = PrefillBootstrapQueue(engine, self.kv_manager, self.polls)
        self.inflight_queue = PrefillInflightQueue(self.polls)
        self.priority = PriorityRules(self.args)

    def is_idle(self) -> bool:
        return not self.bootstrap_queue.queue and not self.inflight_queue.queue

    def close(self) -> None:
        self.kv_manager.close()

    # -- inputs (``SchedulerRole``) ----------------------------------------------------------------------------------
    def admit(self, msg: GenerateReqInput) -> None:
        self.bootstrap_queue.add(msg)

    def abort(self, rid: str, reason: str, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        req = self.engine.intake.find(rid)
        if req is None:
            return
        req.disagg_kv.abort(reason, code)
        if self.bootstrap_queue.remove(req) or self.engine.prefill.take_waiting(lambda r: r is req):
            self.engine.finish_req(req, release=False)
        elif self.inflight_queue.find(rid) is None:
            req.to_abort = reason  # in a prefill batch: stops at its next chunk boundary

    def fill_load(self, load: QueueLoad) -> None:
        load.bootstrap, load.inflight = len(self.bootstrap_queue), len(self.inflight_queue)
        load.queue_by_priority["bootstrap"] = self.priority.queue_by_priority(self.bootstrap_queue.queue)

    def queue_counts(self) -> DisaggQueueCounts:
        return DisaggQueueCounts(bootstrap=len(self.bootstrap_queue), inflight=len(self.inflight_queue))

    # -- the loop's hooks (``SchedulerRole``) ------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.polls.refresh(self.kv_handles())

    def kv_handles(self) -> list[Any]:
        """Every transfer handle a step may act on, in queue order (identical on every TP rank)."""
        reqs = [*self.bootstrap_queue.queue, *self.inflight_queue.queue, *self.engine.prefill.prefilling_reqs()]
        return [r.disagg_kv for r in reqs if r.disagg_kv is not None]

    def poll(self) -> None:
        ready, failed = self.bootstrap_queue.pop_bootstrapped()
        self.engine.prefill.enqueue(ready)
        # Waiting requests whose decode side failed or went away leave before using any compute.
        failed += self.engine.prefill.take_waiting(lambda r: self.polls.poll(r.disagg_kv) == KVPoll.Failed)
        for req in failed:
            self.engine.finish_req(req, release=False)
        self.poll_inflight()

    def waits_for_forward(self) -> bool:
        """The chunked request's pages are sent (read by the transfer) between steps, and memory is allocated
        only after the previous forward finished: pages released meanwhile are reused no earlier than the next
        step."""
        return True

    def on_chunk_done(self, req: Req) -> None:
        """Send the chunked request's pages computed so far.

        NOTE: runs after ``cache_unfinished_req``, which may replace the request's own slots by the radix tree's
        copies and free the originals; sending before it could read freed pages.
        """
        if req.req_pool_idx is None or req.to_abort is not None or self.polls.poll(req.disagg_kv) == KVPoll.Failed:
            return
        full_pages = req.kv_committed_len // self.page_size
        if full_pages > req.kv_pages_sent:
            pages = req_pages(self.engine.req_to_token_pool.req_to_token, req, req.kv_pages_sent,
                              full_pages * self.page_size, self.page_size)
            req.disagg_kv.send(pages)
            req.kv_pages_sent = full_pages

    def chunk_stop(self, req: Req) -> tuple[str, ErrorCode] | None:
        """An aborted request or a failed transfer stops between chunks; its transfer is aborted."""
        if req.to_abort is None and self.polls.poll(req.disagg_kv) != KVPoll.Failed:
            return None
        req.disagg_kv.abort(req.to_abort or "transfer failed")
        if req.to_abort is not None:
            return req.to_abort, ErrorCode.CANCELLED
        return self.polls.failure(req.disagg_kv), self.polls.failure_code(req.disagg_kv)

    def on_prefill_done(self, req: Req) -> None:
        """The first (and only) token ends the request here: the rest of its KV and the token go to decode."""
        refused = _refused(req)
        if req.to_abort is not None:
            req.disagg_kv.abort(req.to_abort)
        elif refused is not None:  # its grammar refused every token: nothing goes to decode
            req.disagg_kv.abort(refused.message, refused.code)
        else:
            self.send_last_pages(req)

    def keep_pages_on_finish(self, req: Req) -> bool:
        """Pages stay locked in the inflight queue until the transfer is final and quiesced on every rank."""
        if id(req) in self.leaving:
            return False
        if _internal(req):
            assert req.finished_reason is not None
            req.disagg_kv.abort(req.finished_reason.message, ErrorCode.INTERNAL)
        self.inflight_queue.add(req)
        return True

    def on_finish(self, req: Req) -> bool:
        self.report(req, self.leaving.pop(id(req), KVPoll.Failed))
        return True

    # -- sending ---------------------------------------------------------------------------------------------------
    def send_last_pages(self, req: Req) -> None:
        total = num_pages(len(req.origin_input_ids), self.page_size)
        pages = req_pages(self.engine.req_to_token_pool.req_to_token, req, req.kv_pages_sent,
                          len(req.origin_input_ids), self.page_size)
        top = req.output_top_logprobs[0][:MAX_TOP_LOGPROBS] if req.output_top_logprobs else []
        spec = self.engine.decode.speculator
        draft = spec.drafter.handoff(req.req_pool_idx) if spec is not None and req.req_pool_idx is not None else None
        metadata = MetadataRecord(
            room=req.bootstrap_room,  # type: ignore[arg-type]
            first_token=req.output_ids[0],
            logprob=req.output_logprobs[0] if req.output_logprobs else 0.0,
            cached_tokens=req.cached_tokens,
            top_ids=tuple(t for t, _ in top),
            top_logprobs=tuple(lp for _, lp in top),
            draft_topk_ids=draft.topk_ids if draft else (),
            draft_topk_p=draft.topk_p if draft else (),
            draft_hidden=draft.hidden if draft else b"",
            draft_kv_len=draft.kv_len if draft else 0,
        )
        req.disagg_kv.send(pages, last=True, metadata=metadata)
        req.kv_pages_sent = total

    # -- finishing -------------------------------------------------------------------------------------------------
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
                logger.log(self.polls.failure_code(req.disagg_kv).log_level, "rid=%s room=%s: KV transfer failed: %s",
                           req.rid, req.bootstrap_room, self.polls.failure(req.disagg_kv))
            self.leaving[id(req)] = state
            self.engine.finish_req(req)  # releases its KV into the radix cache, unlocked

    def report(self, req: Req, state: KVPoll) -> None:
        """Report the Prefill leg's outcome."""
        error = code = None
        refused = _refused(req)
        if _internal(req):
            assert req.finished_reason is not None
            error, code = req.finished_reason.message, ErrorCode.INTERNAL
        elif refused is not None:
            error, code = refused.message, refused.code
        elif state != KVPoll.Success:
            error = req.to_abort or self.polls.failure(req.disagg_kv) or "prefill failed"
            code = ErrorCode.CANCELLED if req.to_abort else self.polls.failure_code(req.disagg_kv)
        sent_bytes = req.kv_pages_sent * self.bytes_per_page
        self.engine.log_request_end(req, "kv sent" if state == KVPoll.Success else f"failed ({error})")
        req.disagg_kv.clear()
        t = req.times
        self.engine.out.send_now([PrefillDone(
            rid=req.rid,
            prompt_tokens=len(req.origin_input_ids),
            cached_tokens=req.cached_tokens,
            error=error,
            error_code=code,
            error_origin=KV_PEER_FAULT if state != KVPoll.Success and not _internal(req) and not req.to_abort
            and refused is None else None,
            timing=Timing(
                queue=max(0.0, (t.forward_start or t.queue_enter) - (t.bootstrapped or t.queue_enter)),
                bootstrap=max(0.0, (t.bootstrapped or t.queue_enter) - t.queue_enter),
                prefill=max(0.0, (t.first_token or t.forward_start) - t.forward_start) if t.forward_start else 0.0,
                transfer=max(0.0, t.transfer_done - (t.first_token or t.transfer_done)) if t.transfer_done else 0.0,
                transfer_bytes=sent_bytes if state == KVPoll.Success else 0,
                e2e=time.monotonic() - t.arrival,
                cached_tokens_host=req.cached_tokens_host,
                cached_tokens_storage=req.cached_tokens_storage,
            ),
        )])


def _internal(req: Req) -> bool:
    """The request failed on an internal error of this rank (reported as INTERNAL, whatever the transfer did)."""
    return req.finished_reason is not None and req.finished_reason.code == ErrorCode.INTERNAL


def _refused(req: Req) -> Finished | None:
    """The request ended on its own input (a grammar's dead end at the first token): why, else None."""
    fr = req.finished_reason
    if fr is not None and fr.reason is FinishReason.ABORT and fr.code == ErrorCode.INVALID_ARGUMENT:
        return fr
    return None
