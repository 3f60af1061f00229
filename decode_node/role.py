"""``DecodeRole``: one decode rank's role in the engine loop, handed to its ``Scheduler``. Holds the KV manager and
its two queues; ``Scheduler.step`` runs the loop and asks the hooks below (``SchedulerRole``), and the role calls
the scheduler back through the narrow ``Engine`` interface only. Every request's KV arrives from its prefill node;
the engine's prefix cache here (``HeldPrefixCache``, unless --disable-radix-cache) keeps only the prompt pages
that requests hold, so that requests with the same prompt (an ``n > 1`` request's choices) receive and hold its
full pages once: the first one's join the cache when they land (``take_transferred``), the others match them at
preallocation. Every release (finish, abort, retraction, transfer failure) goes through the cache: it unlocks,
and the last holder's unlock frees.

Lifecycle of a request: prealloc -> transfer -> running (decode) -> finished::

    begin_step   snapshot every transfer the step acts on (one TP collective)
    admit        a new request waits in the prealloc queue for its prefill peer and for KV memory here
    poll         preallocated -> transfer queue; transferred requests join the running batch with the prefill
                 node's first token (PD prebuilt); failed ones finish
    (the other hooks are empty: from the running batch on, a decode node is a colocated engine)
"""

from __future__ import annotations

import logging
import time

from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput, QueueLoad
from common.engine.mem.held_prefix_cache import HeldPrefixCache
from common.engine.mem.pages import num_pages
from common.engine.priority import PriorityRules
from common.engine.req import Req
from common.engine.scheduler_metrics import DisaggQueueCounts
from common.engine.scheduler_role import Engine, LoopHooks
from common.engine.spec.drafter import DraftHandoff
from common.errors import KV_PEER_FAULT, ErrorCode
from common.faults import inject
from decode_node.prealloc_queue import DecodePreallocQueue
from decode_node.transfer_queue import DecodeTransferQueue
from kvtransfer.node import rank_transfer

logger = logging.getLogger(__name__)


class DecodeRole(LoopHooks):
    def __init__(self, args: ServerArgs) -> None:
        self.args = args

    def bind(self, engine: Engine) -> None:
        self.engine = engine
        self.kv = rank_transfer(self.args, engine.runner, "decode", engine.dp_rank, engine.tp)
        self.kv_manager, self.polls, self.bytes_per_page = self.kv.manager, self.kv.polls, self.kv.bytes_per_page
        self.priority = PriorityRules(self.args)
        cache = engine.tree_cache
        self.prompts = cache if isinstance(cache, HeldPrefixCache) else None
        self.prealloc_queue = DecodePreallocQueue(engine, self.kv_manager, self.args.num_reserved_decode_tokens,
                                                  self.polls, self.priority, self.prompts)
        self.transfer_queue = DecodeTransferQueue(self.polls, self.priority.order_key())

    def is_idle(self) -> bool:
        return not self.prealloc_queue.queue and not self.transfer_queue.queue

    def close(self) -> None:
        self.kv_manager.close()

    # -- inputs (``SchedulerRole``) ----------------------------------------------------------------------------------
    def queue_counts(self) -> DisaggQueueCounts:
        return DisaggQueueCounts(prealloc=len(self.prealloc_queue), transfer=len(self.transfer_queue))

    def admit(self, msg: GenerateReqInput) -> None:
        self.prealloc_queue.add(msg)

    def fill_load(self, load: QueueLoad) -> None:
        load.prealloc, load.transfer = len(self.prealloc_queue), len(self.transfer_queue)
        by_priority = self.priority.queue_by_priority
        load.queue_by_priority.update(prealloc=by_priority(self.prealloc_queue.queue),
                                      transfer=by_priority(self.transfer_queue.queue))
        load.admissible_tokens = self.prealloc_queue.admissible_tokens(len(self.transfer_queue))
        load.preempt_priority = self.prealloc_queue.preempt_priority()

    def abort(self, rid: str, reason: str, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        req = self.engine.intake.find(rid)
        if req is None:
            return
        if self.prealloc_queue.remove(req):
            req.disagg_kv.abort(reason, code)
            req.disagg_kv.clear()
            req.abort(reason)
            self.engine.finish_req(req, release=False)
        elif self.transfer_queue.find(rid) is not None:
            req.to_abort = reason
            req.disagg_kv.abort(reason, code)  # pages are freed once the receiver is quiesced
        else:
            self.engine.abort_request(rid, reason)

    # -- the loop's hooks (``SchedulerRole``) ------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.polls.refresh([r.disagg_kv for r in (*self.prealloc_queue.queue, *self.transfer_queue.queue)])

    def poll(self) -> None:
        admitted, failed = self.prealloc_queue.pop_preallocated(len(self.transfer_queue), self.transfer_queue.queue)
        self.transfer_queue.extend(admitted)
        transferred, transfer_failed = self.transfer_queue.pop_transferred()
        for req in failed + transfer_failed:
            self.fail(req)
        now = time.monotonic()
        self.engine.add_prebuilt(transferred, lambda req: self.take_transferred(req, now))

    # -- transfers -------------------------------------------------------------------------------------------------
    def fail(self, req: Req) -> None:
        """A request whose transfer failed or was aborted: free its pages (quiesced) and report why."""
        reason = req.to_abort or self.polls.failure(req.disagg_kv) or "KV transfer failed"
        code = ErrorCode.CANCELLED if req.to_abort else self.polls.failure_code(req.disagg_kv)
        if req.to_abort is None:
            logger.log(code.log_level, "rid=%s room=%s: %s", req.rid, req.bootstrap_room, reason)
        req.disagg_kv.clear()
        self.prealloc_queue.release_metadata_slot(req)
        req.abort(reason, code, origin="" if req.to_abort else KV_PEER_FAULT)
        self.engine.finish_req(req, release=req.req_pool_idx is not None)

    def take_transferred(self, req: Req, now: float) -> None:
        """The transfer callback: the prefill node's first token and metadata become the request's first output."""
        md = req.disagg_kv.metadata()
        req.disagg_kv.clear()
        self.prealloc_queue.release_metadata_slot(req)
        inject("transfer", req.rid)  # test-only fault hook (after the handle and its slot are released)
        req.times.transfer_done = req.times.first_token = now
        req.cached_tokens = md.cached_tokens
        held_pages = len(req.prefix_indices) // self.args.page_size  # matched at preallocation: not moved
        req.kv_transfer_bytes = (num_pages(len(req.origin_input_ids), self.args.page_size) - held_pages) * (
            self.bytes_per_page)
        shared = self.prealloc_queue.shared_len(req)
        if self.prompts is not None and shared:
            self.prompts.cache_prompt(req, shared)  # landed: requests with this prompt share its full pages
        spec = self.engine.decode.speculator
        # EAGLE's state, STANDALONE's prompt KV (all of the prompt, or the draft extends over it itself): drafts from step 1
        landed = md.draft_kv_len if md.draft_kv_len == len(req.origin_input_ids) else 0
        if spec is not None and (md.draft_topk_ids or landed) and req.req_pool_idx is not None:
            spec.drafter.resume(req.req_pool_idx, DraftHandoff(md.draft_topk_ids, md.draft_topk_p, md.draft_hidden,
                                                               landed))
        top = list(zip(md.top_ids, md.top_logprobs, strict=True))
        req.take_token(md.first_token, self.engine.tokenizer, md.logprob, top)  # a grammar starts from P's token
