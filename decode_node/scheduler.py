"""``DecodeScheduler``: one decode rank's role in the engine loop. Holds the engine's ``Scheduler``, the KV manager
and its two queues; ``Scheduler.step`` runs the loop and asks the hooks below (``SchedulerRole``).

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
from collections.abc import Callable
from typing import Any

from common.config import ServerArgs
from common.engine.distributed import TPGroup
from common.engine.mem.pages import bytes_per_page
from common.engine.req import Req
from common.engine.sampling.stop import check_finished
from common.engine.scheduler import Scheduler
from common.engine.scheduler_metrics import DisaggQueueCounts
from common.engine.scheduler_role import LoopHooks
from common.errors import KV_PEER_FAULT, ErrorCode
from common.faults import inject
from common.io_struct import GenerateReqInput, QueueLoad, SchedulerInput
from decode_node.prealloc_queue import DecodePreallocQueue
from decode_node.transfer_queue import DecodeTransferQueue
from kvtransfer.node import make_kv_manager
from kvtransfer.poll import GroupPolls

logger = logging.getLogger(__name__)


class DecodeScheduler(LoopHooks):
    def __init__(
        self, args: ServerArgs, model_path: str, tokenizer: Any, send_outputs: Callable[[list[Any]], None],
        dp_rank: int = 0,
        tp: TPGroup | None = None,
    ) -> None:
        # The decode side never matches prefixes: every request's KV arrives whole from its prefill node.
        self.args = args.replace(disable_radix_cache=True)
        self.sched = Scheduler(self.args, model_path, tokenizer, send_outputs, dp_rank, tp)
        self.tokenizer = tokenizer
        tp = self.sched.tp
        self.kv_manager = make_kv_manager(self.args, self.sched.runner, "decode", dp_rank, tp_rank=tp.tp_rank,
                                          tp_size=tp.tp_size)
        self.polls = GroupPolls(tp.all_reduce_min, tp.tp_rank, tp.tp_size)
        self.prealloc_queue = DecodePreallocQueue(self.sched, self.kv_manager, args.num_reserved_decode_tokens,
                                                  self.polls)
        self.transfer_queue = DecodeTransferQueue(self.polls)
        pool = self.sched.runner.kv_pool
        self.bytes_per_page = bytes_per_page(pool) * self.sched.model_config.num_kv_heads // pool.num_kv_heads
        self.sched.role = self

    @property
    def max_total_num_tokens(self) -> int:
        return self.sched.max_total_num_tokens

    def step(self, msgs: list[SchedulerInput]) -> bool:
        return self.sched.step(msgs)

    def is_idle(self) -> bool:
        return self.sched.is_idle() and not self.prealloc_queue.queue and not self.transfer_queue.queue

    def close(self) -> None:
        self.sched.close()
        self.kv_manager.close()

    # -- inputs (``SchedulerRole``) ----------------------------------------------------------------------------------
    def queue_counts(self) -> DisaggQueueCounts:
        return DisaggQueueCounts(prealloc=len(self.prealloc_queue), transfer=len(self.transfer_queue))

    def admit(self, msg: GenerateReqInput) -> None:
        self.prealloc_queue.add(msg)

    def fill_load(self, load: QueueLoad) -> None:
        load.prealloc, load.transfer = len(self.prealloc_queue), len(self.transfer_queue)
        load.admissible_tokens = self.prealloc_queue.admissible_tokens(len(self.transfer_queue))

    def abort(self, rid: str, reason: str, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        req = self.sched.reqs_by_rid.get(rid)
        if req is None:
            return
        if self.prealloc_queue.remove(req):
            req.disagg_kv.abort(reason, code)
            req.disagg_kv.clear()
            req.abort(reason)
            self.sched.finish_req(req, release=False)
        elif self.transfer_queue.find(rid) is not None:
            req.to_abort = reason
            req.disagg_kv.abort(reason, code)  # pages are freed once the receiver is quiesced
        else:
            self.sched.abort_request(rid, reason)

    # -- the loop's hooks (``SchedulerRole``) ------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.polls.refresh([r.disagg_kv for r in (*self.prealloc_queue.queue, *self.transfer_queue.queue)])

    def poll(self) -> None:
        admitted, failed = self.prealloc_queue.pop_preallocated(len(self.transfer_queue))
        self.transfer_queue.extend(admitted)
        transferred, transfer_failed = self.transfer_queue.pop_transferred()
        for req in failed + transfer_failed:
            self.fail(req)
        now = time.monotonic()
        self.sched.add_prebuilt(transferred, lambda req: self.take_transferred(req, now))

    # -- transfers -------------------------------------------------------------------------------------------------
    def fail(self, req: Req) -> None:
        """A request whose transfer failed or was aborted: free its pages (quiesced) and report why."""
        reason = req.to_abort or self.polls.failure(req.disagg_kv) or "KV transfer failed"
        code = ErrorCode.CANCELLED if req.to_abort else self.polls.failure_code(req.disagg_kv)
        if req.to_abort is None:
            logger.warning("rid=%s room=%s: %s", req.rid, req.bootstrap_room, reason)
        req.disagg_kv.clear()
        self.prealloc_queue.release_metadata_slot(req)
        req.abort(reason, code, origin="" if req.to_abort else KV_PEER_FAULT)
        self.sched.finish_req(req, release=req.req_pool_idx is not None)

    def take_transferred(self, req: Req, now: float) -> None:
        """The transfer callback: the prefill node's first token and metadata become the request's first output."""
        md = req.disagg_kv.metadata()
        req.disagg_kv.clear()
        self.prealloc_queue.release_metadata_slot(req)
        inject("transfer", req.rid)  # test-only fault hook (after the handle and its slot are released)
        req.times.transfer_done = req.times.first_token = now
        req.cached_tokens = md.cached_tokens
        req.kv_transfer_bytes = -(-len(req.origin_input_ids) // self.args.page_size) * self.bytes_per_page
        if not self.sched.accept_grammar(req, md.first_token):  # the grammar's matcher starts from P's token
            return
        req.output_ids.append(md.first_token)
        if req.return_logprob:
            req.output_logprobs.append(md.logprob)
            req.output_top_logprobs.append(list(zip(md.top_ids, md.top_logprobs, strict=True)))
        check_finished(req, md.first_token, self.tokenizer)
        self.sched.finish_on_grammar(req, md.first_token)
