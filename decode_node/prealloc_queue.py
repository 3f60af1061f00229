"""``DecodePreallocQueue``: requests waiting for their prefill peer to be resolved and for KV memory here.

Admission budget (tokens), in arrival order (most urgent first with priority scheduling), retracted requests first (they wait in the prefill manager's queue and
block new admissions until they are back)::

    free slots - num_reserved_decode_tokens * (running + transferring + admitted this round)
               - the longest remaining generation of one running request (so at least one can always finish)

Shared prompts (``prompts``, the rank's ``HeldPrefixCache``; off with --disable-radix-cache): a request whose
prompt's full pages (all but the last page: each sequence writes its own tokens after the prompt) are held for
other requests matches and locks them, allocates only the rest and sends page 0 for the held ones (prefill moves
nothing for them, ``kvtransfer.prefill_rooms``); its budget counts only the rest. A request whose prompt is the same as
one in transit here waits (not blocking the queue) until that one's KV has landed and joined the cache, or left:
one transfer of a repeated prompt's shared pages at a time. That wait ends at the latest half a
``--bootstrap-timeout`` after the request arrived (its prefill peer waits that long for destination pages): it then
receives the prompt whole, and its copy of the full pages is folded into the held one when it lands
(``HeldPrefixCache.cache_prompt``). Any TP rank's clock ending a wait ends it on every rank (one collective per
step while some request waits).

Priority scheduling (``rules``): retracted requests block only the requests they are at least as urgent as, and a
head that does not fit preempts running requests it beats by more than the threshold (least urgent and newest
first, as many as its prompt needs; none unless that many exist). Their pages become allocatable once the batch in
flight is done, so the head is admitted at a later step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from common.engine.io_struct import GenerateReqInput
from common.engine.mem.held_prefix_cache import HeldPrefixCache
from common.engine.mem.pages import req_pages
from common.engine.priority import PriorityRules
from common.engine.req import Req
from common.engine.scheduler_role import Engine
from common.errors import ErrorCode
from kvtransfer.manager import KVManager
from kvtransfer.poll import GroupPolls, KVPoll
from kvtransfer.receiver import KVReceiver


class DecodePreallocQueue:
    def __init__(self, engine: Engine, kv_manager: KVManager, num_reserved_decode_tokens: int,
                 polls: GroupPolls, rules: PriorityRules | None = None,
                 prompts: HeldPrefixCache | None = None) -> None:
        self.engine = engine
        self.page_size = engine.args.page_size
        self.prompts = prompts
        self.rules = rules if rules is not None and rules.priority_on else None
        self.order: Callable[[Req], int] | None = self.rules.urgency if self.rules else None  # the head: most urgent
        self.polls = polls
        self.kv_manager = kv_manager
        self.reserved = num_reserved_decode_tokens
        self.queue: list[Req] = []
        self.free_metadata_slots = list(range(kv_manager.args.num_metadata_slots))
        self.waiting_for_prompt: set[str] = set()  # rids of the requests held last round for a prompt in transit

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, msg: GenerateReqInput) -> Req | None:
        if msg.bootstrap_room is None:
            self.engine.out.error(msg.rid, "bootstrap_room is required on a decode node", ErrorCode.INVALID_ARGUMENT)
            return None
        if not msg.bootstrap_addr:
            self.engine.out.error(msg.rid, "bootstrap_addr (the prefill node's host:port) is required on a "
                                     "decode node", ErrorCode.INVALID_ARGUMENT)
            return None
        req = self.engine.intake.build_req(msg)
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

    def allocatable_tokens(self, num_active: int, leaving: frozenset[int] = frozenset()) -> int:
        """The budget with every running request but those whose ``id`` is in ``leaving``."""
        s = self.engine
        running = [r for r in s.decode.running_batch.reqs if id(r) not in leaving]
        longest = max((r.sampling_params.max_new_tokens - len(r.output_ids) for r in running), default=0)
        return s.allocator.available_size() - self.reserved * num_active - longest

    def admissible_tokens(self, num_transferring: int) -> int:
        """Prompt tokens one more request could bring now under ``pop_preallocated``'s rule, behind the queue."""
        s = self.engine
        if (s.prefill.num_waiting() or not self.free_metadata_slots
                or s.req_to_token_pool.available_size() <= len(self.queue)):
            return 0
        active = len(s.decode.running_batch.reqs) + num_transferring + len(self.queue) + 1
        ahead = sum(len(r.origin_input_ids) + self.page_size for r in self.queue)
        return max(0, self.allocatable_tokens(active) - ahead - self.page_size)

    def preempt_priority(self) -> int | None:
        """The priority a request must be more urgent than to preempt a running request here (None: it cannot)."""
        rules = self.rules
        running = self.engine.decode.running_batch.reqs
        if rules is None or not running or not self.free_metadata_slots:
            return None
        # urgency(r) - urgency(w) > threshold  <=>  urgency(w) < urgency(least urgent) - threshold
        bound = max(rules.urgency(r) for r in running) - rules.threshold
        return bound * rules.sign  # urgency = priority * sign, sign = +-1

    def pop_preallocated(self, num_transferring: int, transferring: Sequence[Req] = ()
                         ) -> tuple[list[Req], list[Req]]:
        """Requests that got their slot and pages (destination indices sent), and those that failed to resolve.
        ``transferring``: the requests whose KV is in transit (a request with the same prompt waits for them)."""
        s = self.engine
        in_transit = {r.prompt_key: r for r in transferring if self.shared_len(r)}
        waited_enough = self._waited_enough()
        self.waiting_for_prompt = set()
        admitted: list[Req] = []
        failed: list[Req] = []
        keep: list[Req] = []
        retracted = s.prefill.prefilling_reqs()  # on a decode node: retracted requests, to recompute
        most_urgent_retracted = min(map(self.order, retracted), default=None) if self.order else None
        blocked = False
        if self.order is not None:
            self.queue.sort(key=self.order)  # stable: arrival order within a priority
        for req in self.queue:
            state = self.polls.poll(req.disagg_kv)  # every TP rank resolved its prefill sources
            if state == KVPoll.Failed:
                failed.append(req)
                continue
            # retracted requests come back first: all of them, or with priority scheduling those as urgent
            behind = bool(retracted) if self.order is None else (
                most_urgent_retracted is not None and most_urgent_retracted <= self.order(req))
            if blocked or state < KVPoll.WaitingForInput or behind:
                blocked = True  # in order: nobody overtakes the head of the queue
                keep.append(req)
                continue
            if (self.prompts is not None and req.rid not in waited_enough
                    and _same_prompt(in_transit.get(req.prompt_key), req)):
                keep.append(req)  # its prompt's pages are on their way for another request
                self.waiting_for_prompt.add(req.rid)
                continue
            active = len(s.decode.running_batch.reqs) + num_transferring + len(admitted) + 1
            need = len(req.origin_input_ids) - self.held_len(req) + self.page_size
            if need > self.allocatable_tokens(active) or not self._allocate(req):
                if not admitted:
                    self._preempt_for(req, need, active)
                blocked = True
                keep.append(req)
                continue
            admitted.append(req)
            if self.shared_len(req):
                in_transit.setdefault(req.prompt_key, req)
        self.queue = keep
        return admitted, failed

    def _preempt_for(self, head: Req, need: int, active: int) -> None:
        """Priority scheduling: retract the running requests ``head`` beats, least urgent and newest first, as many
        as its prompt and a request slot need (none unless that many exist)."""
        rules, s = self.rules, self.engine
        if rules is None or not self.free_metadata_slots:  # a metadata slot comes back with a transfer, not a victim
            return
        victims = sorted((r for r in s.decode.running_batch.reqs if not r.finished() and rules.beats(head, r)),
                         key=lambda r: (-rules.urgency(r), -r.arrival_seq))
        chosen: list[Req] = []
        freed = 0
        short_of_slot = s.req_to_token_pool.available_size() <= 0
        for v in victims:
            leaving = frozenset(id(r) for r in chosen)
            if not short_of_slot and need <= self.allocatable_tokens(active - len(chosen), leaving) + freed:
                break
            chosen.append(v)
            freed += -(-v.kv_committed_len // self.page_size) * self.page_size
            short_of_slot = False
        leaving = frozenset(id(r) for r in chosen)
        if chosen and need <= self.allocatable_tokens(active - len(chosen), leaving) + freed:
            s.preempt_running(chosen, head)

    def _waited_enough(self) -> set[str]:
        """Rids of the requests held for a prompt in transit that may wait no longer (see the module docstring)."""
        held = [r for r in self.queue if r.rid in self.waiting_for_prompt]  # the same list on every TP rank
        if not held:
            return set()
        limit, now = self.engine.args.bootstrap_timeout / 2, time.monotonic()
        late = torch.tensor([-int(now - r.times.arrival >= limit) for r in held], dtype=torch.int64)
        if self.engine.tp.tp_size > 1:
            late = self.engine.tp.all_reduce_min(late)  # late on one rank: late on all
        return {r.rid for r, flag in zip(held, late.tolist(), strict=True) if flag}

    def shared_len(self, req: Req) -> int:
        """Prompt positions a request may share (its full pages but the last page): 0 without sharing."""
        if self.prompts is None:
            return 0
        return (len(req.origin_input_ids) - 1) // self.page_size * self.page_size

    def held_len(self, req: Req) -> int:
        """Prompt positions held here for other requests that ``req`` would share (read-only)."""
        n = self.shared_len(req)
        return self.prompts.peek_prefix(req.origin_input_ids[:n])[0] if self.prompts is not None and n else 0

    def _allocate(self, req: Req) -> bool:
        """A request slot and KV pages for the prompt: the held prefix locked (``req.last_node``), the rest new;
        page 0 is announced for the held pages."""
        s = self.engine
        if not self.free_metadata_slots:
            return False
        slots = s.req_to_token_pool.alloc(1)
        if slots is None:
            return False
        n = len(req.origin_input_ids)
        held = torch.empty(0, dtype=torch.int64)
        node = None
        if self.prompts is not None and self.shared_len(req):
            match = self.prompts.match_prefix(req.origin_input_ids[:self.shared_len(req)])
            held, node = match.device_indices, match.last_node
            self.prompts.inc_lock_ref(node)
        kv = s.allocator.alloc_extend([len(held)], [n], [-1])  # the held prefix is whole pages
        if kv is None:
            if self.prompts is not None:
                self.prompts.dec_lock_ref(node)
            s.req_to_token_pool.free(slots)
            return False
        req.req_pool_idx = slots[0]
        s.req_to_token_pool.write(req.req_pool_idx, 0, held)
        s.req_to_token_pool.write(req.req_pool_idx, len(held), kv)
        req.kv_committed_len = n
        req.prefix_indices, req.last_node = held, node
        req.metadata_slot = self.free_metadata_slots.pop()
        pages = req_pages(s.req_to_token_pool.req_to_token, req, 0, n, self.page_size)
        pages[: len(held) // self.page_size] = [0] * (len(held) // self.page_size)  # held here: nothing to move
        req.disagg_kv.send_metadata(pages, req.metadata_slot)
        req.times.bootstrapped = time.monotonic()
        return True

    def release_metadata_slot(self, req: Req) -> None:
        if req.metadata_slot is not None:
            self.free_metadata_slots.append(req.metadata_slot)
            req.metadata_slot = None


def _same_prompt(other: Req | None, req: Req) -> bool:
    return other is not None and other is not req and other.origin_input_ids == req.origin_input_ids
