"""``DecodePreallocQueue``: requests waiting for their prefill peer to be resolved and for KV memory here.

Admission budget (tokens), in arrival order, retracted requests first (they wait in the scheduler's queue and
block new admissions until they are back)::

    free slots - num_reserved_decode_tokens * (running + transferring + admitted this round)
               - the longest remaining generation of one running request (so at least one can always finish)
"""

from __future__ import annotations

import time

import torch

from common.engine.mem.pages import req_pages
from common.engine.req import Req
from common.engine.scheduler import Scheduler
from common.errors import ErrorCode
from common.io_struct import GenerateReqInput
from kvtransfer.manager import KVManager
from kvtransfer.poll import GroupPolls, KVPoll
from kvtransfer.receiver import KVReceiver


class DecodePreallocQueue:
    def __init__(self, scheduler: Scheduler, kv_manager: KVManager, num_reserved_decode_tokens: int,
                 polls: GroupPolls) -> None:
        self.scheduler = scheduler
        self.polls = polls
        self.kv_manager = kv_manager
        self.reserved = num_reserved_decode_tokens
        self.queue: list[Req] = []
        self.free_metadata_slots = list(range(kv_manager.args.num_metadata_slots))

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, msg: GenerateReqInput) -> Req | None:
        if msg.bootstrap_room is None:
            self.scheduler.out.error(msg.rid, "bootstrap_room is required on a decode node", ErrorCode.INVALID_ARGUMENT)
            return None
        if not msg.bootstrap_addr:
            self.scheduler.out.error(msg.rid, "bootstrap_addr (the prefill node's host:port) is required on a "
                                     "decode node", ErrorCode.INVALID_ARGUMENT)
            return None
        req = self.scheduler.build_req(msg)
        if req is None:
            return None
        req.bootstrap_addr = msg.bootstrap_addr
        req.prefill_dp_rank = msg.prefill_dp_rank or 0
        req.disagg_kv = KVReceiver(self.kv_manager, msg.bootstrap_room, msg.bootstrap_addr)
        req.disagg_kv.init(req.prefill_dp_rank)
        self.queue.append(req)
        return req

    def remove(self, req: Req) -> bool:
        if req in self.queue:
            self.queue.remove(req)
            return True
        return False

    def allocatable_tokens(self, num_active: int) -> int:
        s = self.scheduler
        running = s.running_batch.reqs
        longest = max((r.sampling_params.max_new_tokens - len(r.output_ids) for r in running), default=0)
        return s.allocator.available_size() - self.reserved * num_active - longest

    def admissible_tokens(self, num_transferring: int) -> int:
        """Prompt tokens one more request could bring now under ``pop_preallocated``'s rule, behind the queue."""
        s = self.scheduler
        if s.waiting_queue or not self.free_metadata_slots or s.req_to_token_pool.available_size() <= len(self.queue):
            return 0
        active = len(s.running_batch.reqs) + num_transferring + len(self.queue) + 1
        ahead = sum(len(r.origin_input_ids) + s.page_size for r in self.queue)
        return max(0, self.allocatable_tokens(active) - ahead - s.page_size)

    def pop_preallocated(self, num_transferring: int) -> tuple[list[Req], list[Req]]:
        """Requests that got their slot and pages (destination indices sent), and those that failed to resolve."""
        s = self.scheduler
        admitted: list[Req] = []
        failed: list[Req] = []
        keep: list[Req] = []
        blocked = bool(s.waiting_queue)  # retracted requests come back first
        for req in self.queue:
            state = self.polls.poll(req.disagg_kv)  # every TP rank resolved its prefill sources
            if state == KVPoll.Failed:
                failed.append(req)
                continue
            if blocked or state < KVPoll.WaitingForInput:
                keep.append(req)
                continue
            active = len(s.running_batch.reqs) + num_transferring + len(admitted) + 1
            need = len(req.origin_input_ids) + s.page_size
            if need > self.allocatable_tokens(active) or not self._allocate(req):
                blocked = True  # in order: nobody overtakes the head of the queue
                keep.append(req)
                continue
            admitted.append(req)
        self.queue = keep
        return admitted, failed

    def _allocate(self, req: Req) -> bool:
        s = self.scheduler
        if not self.free_metadata_slots:
            return False
        slots = s.req_to_token_pool.alloc(1)
        if slots is None:
            return False
        n = len(req.origin_input_ids)
        kv = s.allocator.alloc_extend([0], [n], [-1])
        if kv is None:
            s.req_to_token_pool.free(slots)
            return False
        req.req_pool_idx = slots[0]
        s.req_to_token_pool.write(req.req_pool_idx, 0, kv)
        req.kv_committed_len = n
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.metadata_slot = self.free_metadata_slots.pop()
        pages = req_pages(s.req_to_token_pool.req_to_token, req, 0, n, s.page_size)
        req.disagg_kv.send_metadata(pages, req.metadata_slot)
        req.times.bootstrapped = time.monotonic()
        return True

    def release_metadata_slot(self, req: Req) -> None:
        if req.metadata_slot is not None:
            self.free_metadata_slots.append(req.metadata_slot)
            req.metadata_slot = None
