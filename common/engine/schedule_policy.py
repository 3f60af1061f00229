"""``SchedulePolicy``: the order of the waiting queue (SGLang's ``calc_priority``), in-batch prefix caching and
priority scheduling with preemption. ``PrefillManager.next_batch`` calls ``prepare`` once per round, before
``PrefillAdder`` walks the queue::

    preempt   (--enable-priority-scheduling) the most urgent waiting request retracts running requests it beats by
              more than --priority-scheduling-preemption-threshold, when it could not be admitted otherwise
    order     fcfs        arrival order (priority first when enabled)
              lpm         longest cached prefix first (read-only radix match); fcfs beyond 128 waiting requests
              dfs-weight  radix subtrees with the most waiting requests first, depth first
              lof         longest max_new_tokens first
              random      shuffled (seeded: every TP rank draws the same order)

With priority scheduling every policy orders by urgency first (``priority * sign``, smaller first; sign -1 unless
--schedule-low-priority-values-first). A request without a priority is the least urgent (SGLang's rule).

In-batch prefix caching (lpm and dfs-weight, SGLang's thresholds): a request whose cached prefix is at most
``IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`` tokens and whose first ``..._DEPRIORITIZE_THRESHOLD`` tokens equal
those of a request ahead of it (its leader) sits out the round (``Req.sits_out``) while the leader computes the
shared prefix: the leader is ahead in the queue, or admitted and still prefilling, or finished and holding its
pages (a prefill node's transfer). Once the prefix is cached the follower matches it and runs.

Repeated prompts (fcfs, lof, random; the cache-aware policies catch them above): a fresh request whose whole prompt
equals that of a request ahead of it, or of one still computing it, sits out until that prompt is cached, then
computes only its last page. So the ``n`` choices of one request (the router's and the node's fan-out send them as
``n`` requests with one prompt) and repeated prompts prefill once, whatever the policy (SGLang's tokenizer sends
a prefix-caching request ahead of the ``n`` samples for the same reason).

Invariant: every preempted request re-enters the waiting queue with its pages released (into the radix cache when
it is on) and sits out the round of its preemption, so a token of it still in flight is dropped before it returns.

``PrefillAdder``: picks which waiting requests join the next prefill batch, under three budgets.

    rem_total_tokens  KV slots left after reserving the running requests' expected future tokens
                      (free + evictable - sum(remaining max_new_tokens * new_token_ratio))
    rem_input_tokens  prompt tokens this batch may compute (--max-prefill-tokens)
    rem_chunk_tokens  tokens left in this round's chunk (--chunked-prefill-size); a request that does not fit
                      is truncated to a page multiple and becomes the chunked request
"""

from __future__ import annotations

import enum
import logging
import random
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from common.engine.mem.held_prefix_cache import HeldPrefixCache
from common.engine.mem.radix_cache import RadixCache, TreeNode
from common.engine.priority import PriorityRules

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.req import Req
    from common.engine.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)

CLIP_MAX_NEW_TOKENS = 4096  # caps one request's reservation so a huge max_new_tokens cannot block admission
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32  # cached tokens at most this: check for a shared uncached prefix
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32  # shared with a request ahead at least this: sit out
LPM_FALLBACK_QUEUE_LEN = 128  # lpm orders fcfs beyond this many waiting requests (matching would cost too much)
CACHE_AWARE = ("lpm", "dfs-weight")


class SchedulePolicy(PriorityRules):
    def __init__(self, args: ServerArgs, tree_cache: Any, allocator: Any, req_to_token_pool: Any) -> None:
        super().__init__(args)
        self.args = args
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        # A decode node's tree holds only the prompt pages its requests share (``HeldPrefixCache``): its retracted
        # requests are ordered as without a tree.
        has_tree = isinstance(tree_cache, RadixCache) and not tree_cache.disable and not isinstance(
            tree_cache, HeldPrefixCache)
        # Without a radix tree there is no prefix to match: cache-aware policies order fcfs (as SGLang).
        self.policy = args.schedule_policy if has_tree or args.schedule_policy not in CACHE_AWARE else "fcfs"
        self.rng = random.Random(args.seed)
        self.leaders: dict[tuple[int, ...], Req] = {}  # in-batch prefix caching: who computes each shared head
        self.has_tree = has_tree
        self.prompt_leaders: dict[tuple[int, int], Req] = {}  # repeated prompts: who computes each one
        self.num_preempted = 0

    # -- the round -------------------------------------------------------------------------------------------------
    def prepare(self, waiting: list[Req], running_batch: ScheduleBatch, new_token_ratio: float) -> None:
        """Preempt for the most urgent waiting request if it must, then order ``waiting`` in place."""
        if not waiting:
            return
        preempted = self.preempt(waiting, running_batch, new_token_ratio) if self.priority_on else []
        if running_batch.batch_is_full:
            return  # no admission this round: ordering would be wasted work
        self.calc_priority(waiting)
        for req in preempted:
            req.sits_out = True

    def calc_priority(self, waiting: list[Req]) -> None:
        for req in waiting:
            req.sits_out = False
        policy = self.policy
        if policy == "lpm" and len(waiting) > LPM_FALLBACK_QUEUE_LEN:
            policy = "fcfs"
        if policy == "fcfs":
            if self.priority_on:
                waiting.sort(key=lambda r: (self.urgency(r), r.arrival_seq))
        elif policy in CACHE_AWARE:
            matched = self.match_prefixes(waiting)
            if policy == "lpm":
                waiting.sort(key=lambda r: (self.urgency(r), r.sits_out, -matched[id(r)][0]))
            else:
                waiting[:] = self.dfs_weight_order(waiting, {k: node for k, (_, node) in matched.items()})
                if self.priority_on:
                    waiting.sort(key=self.urgency)
        elif policy == "lof":
            waiting.sort(key=lambda r: (self.urgency(r), -r.sampling_params.max_new_tokens))
        else:  # random
            self.rng.shuffle(waiting)
            if self.priority_on:
                waiting.sort(key=self.urgency)
        if policy not in CACHE_AWARE and self.has_tree:
            self.hold_repeated_prompts(waiting)

    def hold_repeated_prompts(self, waiting: list[Req]) -> None:
        """Marks ``sits_out`` each fresh request whose prompt a request ahead of it (in ``waiting``'s order) or one
        still computing it (``_computing``) has: one prefill per distinct prompt at a time."""
        queued = {id(r) for r in waiting}
        leaders = {k: r for k, r in self.prompt_leaders.items() if id(r) not in queued and _computing(r)}
        for req in waiting:
            if req.output_ids or len(req.origin_input_ids) <= self.allocator.page_size:  # nothing to share
                continue
            leader = leaders.setdefault(req.prompt_key, req)
            if leader is not req and leader.origin_input_ids == req.origin_input_ids:  # the key may collide
                req.sits_out = True
        self.prompt_leaders = leaders

    # -- cache-aware policies --------------------------------------------------------------------------------------
    def match_prefixes(self, waiting: list[Req]) -> dict[int, tuple[int, TreeNode]]:
        """Each request's cached prefix (length, deepest node), read-only; marks in-batch followers ``sits_out``."""
        queued = {id(r) for r in waiting}
        leaders = {head: r for head, r in self.leaders.items() if id(r) not in queued and _computing(r)}
        out: dict[int, tuple[int, TreeNode]] = {}
        for req in waiting:
            key = (req.origin_input_ids + req.output_ids)[:-1]  # what init_next_round_input matches
            n, node = self.tree_cache.peek_prefix(key)
            out[id(req)] = (n, node)
            if n > IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD or len(key) < IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                continue
            head = tuple(key[:IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD])
            leader = leaders.setdefault(head, req)
            if leader is not req:
                req.sits_out = True
        self.leaders = leaders
        return out

    def dfs_weight_order(self, waiting: list[Req], node_of: dict[int, TreeNode]) -> list[Req]:
        """Depth first over the radix tree, heavier subtrees (more waiting requests below) first; a node's own
        requests after its subtree's."""
        at_node: dict[TreeNode, list[Req]] = defaultdict(list)
        for req in waiting:
            at_node[node_of[id(req)]].append(req)
        weight: dict[TreeNode, int] = defaultdict(int)
        for node, reqs in at_node.items():
            walk: TreeNode | None = node
            while walk is not None:
                weight[walk] += len(reqs)
                walk = walk.parent
        order: list[Req] = []
        stack: list[tuple[TreeNode, bool]] = [(self.tree_cache.root_node, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.extend(at_node.get(node, ()))
                continue
            stack.append((node, True))
            children = sorted((c for c in node.children.values() if weight.get(c)), key=lambda c: -weight[c])
            stack.extend((c, False) for c in reversed(children))
        return order

    # -- preemption ------------------------------------------------------------------------------------------------
    def preempt(self, waiting: list[Req], running_batch: ScheduleBatch, new_token_ratio: float) -> list[Req]:
        """Retract the least urgent running requests the most urgent waiting one beats, least urgent and newest
        first, as many as it needs to fit (a slot and KV tokens); none unless that many exist. Returns them, back
        in ``waiting``."""
        if running_batch.is_empty():
            return []
        head = min(waiting, key=self.urgency)
        victims = sorted((r for r in running_batch.reqs if not r.finished() and self.beats(head, r)),
                         key=lambda r: (-self.urgency(r), -r.arrival_seq))
        if not victims:
            return []
        args, page = self.args, self.allocator.page_size
        adder = PrefillAdder(page, self.tree_cache, self.allocator, running_batch.reqs, new_token_ratio,
                             args.max_prefill_tokens, args.chunk_size)
        spare = adder.rem_total_tokens
        ids = head.origin_input_ids + head.output_ids
        cached = self.tree_cache.peek_prefix(ids[:-1])[0] if isinstance(self.tree_cache, RadixCache) else 0
        need = len(ids) - cached + min(head.sampling_params.max_new_tokens - len(head.output_ids), CLIP_MAX_NEW_TOKENS)
        short_of_slot = len(running_batch.reqs) >= args.max_running_requests or (
            head.req_pool_idx is None and self.req_to_token_pool.available_size() <= 0)
        chosen: list[Req] = []
        for v in victims:
            if not short_of_slot and need < spare:
                break
            chosen.append(v)
            remaining = min(v.sampling_params.max_new_tokens - len(v.output_ids), CLIP_MAX_NEW_TOKENS)
            spare += ceil_to(int(remaining * new_token_ratio), page) + page + v.kv_committed_len
            short_of_slot = False
        if not chosen or short_of_slot or need >= spare:
            return []
        self.retract(running_batch, chosen, head)
        waiting.extend(chosen)
        return chosen

    def retract(self, running_batch: ScheduleBatch, victims: list[Req], head: Req) -> None:
        """Take ``victims`` out of the running batch for ``head``, their KV released (to be recomputed)."""
        for v in victims:
            running_batch.release_req_memory(v)
            v.reset_for_retract()
        gone = {id(v) for v in victims}
        running_batch.filter_batch(keep=[r for r in running_batch.reqs if id(r) not in gone])
        running_batch.batch_is_full = False
        self.num_preempted += len(victims)
        logger.info("Priority preemption: rid=%s (priority %d) retracted %d running requests (%s)", head.rid,
                    head.priority, len(victims), ", ".join(f"rid={v.rid} priority {v.priority}" for v in victims))


class PrefillAdder:
    def __init__(
        self,
        page_size: int,
        tree_cache: Any,
        allocator: Any,
        running_reqs: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        mixed_with_decode_tokens: int = 0,
    ) -> None:
        self.page_size = page_size
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = max_prefill_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = None if chunked_prefill_size is None else chunked_prefill_size - mixed_with_decode_tokens
        self.rem_total_token_offset = mixed_with_decode_tokens + sum(
            ceil_to(
                int(min(r.sampling_params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * new_token_ratio),
                page_size,
            )
            + page_size
            for r in running_reqs
        )
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None
        self.log_input_tokens = 0
        self.log_hit_tokens = 0

    @property
    def rem_total_tokens(self) -> int:
        evictable = self.tree_cache.evictable_size() if self.tree_cache is not None else 0
        return self.allocator.available_size() + evictable - self.rem_total_token_offset

    def _update_budget(self, req: Req, extend_input_len: int, max_new_tokens: int, cache_hit: bool = True) -> None:
        extend = ceil_to(extend_input_len, self.page_size)
        self.rem_total_token_offset += extend + ceil_to(max_new_tokens, self.page_size) + self.page_size
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend
        self.log_input_tokens += extend_input_len
        if cache_hit:  # a chunked request's earlier chunks are its own KV, not prefix-cache hits
            self.log_hit_tokens += len(req.prefix_indices)

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def add_chunked_req(self, req: Req) -> Req | None:
        """Continue the chunked request; returns it again while more chunks remain."""
        limit = req.extend_input_len if self.rem_chunk_tokens is None else self.rem_chunk_tokens
        truncated = req.extend_input_len > limit
        req.extend_input_len = min(req.extend_input_len, limit)
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + req.extend_input_len]
        self.can_run_list.append(req)
        self._update_budget(req, req.extend_input_len, 0 if truncated else self._max_new(req), cache_hit=False)
        return req if truncated else None

    def load_quota(self, req: Req) -> int:
        """KV slots left once ``req`` is counted in whole (as ``add_one_req`` counts it): a load of its prefix from a
        lower tier starts only when this is positive (loaded tokens replace tokens it would compute)."""
        if req.sits_out:
            return 0
        return self.rem_total_tokens - req.extend_input_len - self._max_new(req)

    @staticmethod
    def _max_new(req: Req) -> int:
        return min(req.sampling_params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)

    def add_one_req(self, req: Req) -> AddReqResult:
        if req.sits_out:  # the schedule policy keeps it out of this round (common.engine.schedule_policy)
            return self.budget_state()
        total_tokens = req.extend_input_len + self._max_new(req)
        input_tokens = ceil_to(req.extend_input_len, self.page_size)
        if total_tokens >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if input_tokens > self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        if self.tree_cache is not None:
            self.tree_cache.inc_lock_ref(req.last_node)
        if total_tokens >= self.rem_total_tokens:  # locking the prefix may have made it unevictable
            if self.tree_cache is not None:
                self.tree_cache.dec_lock_ref(req.last_node)
            return AddReqResult.NO_TOKEN
        if self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens:
            self.can_run_list.append(req)
            self._update_budget(req, req.extend_input_len, self._max_new(req))
        else:
            trunc_len = self.rem_chunk_tokens // self.page_size * self.page_size
            if trunc_len <= 0:
                if self.tree_cache is not None:
                    self.tree_cache.dec_lock_ref(req.last_node)
                return AddReqResult.OTHER
            req.extend_input_len = trunc_len
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + trunc_len]
            self.can_run_list.append(req)
            self.new_chunked_req = req
            self._update_budget(req, trunc_len, 0)
        return self.budget_state()


class AddReqResult(enum.Enum):
    CONTINUE = enum.auto()  # room for more
    NO_TOKEN = enum.auto()  # KV memory exhausted
    OTHER = enum.auto()  # input or chunk budget exhausted


def ceil_to(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


def _computing(leader: Req) -> bool:
    """A leader out of the queue still computes its prefix: admitted and not through prefill, or finished with its
    pages held (a prefill node's transfer: they reach the radix cache when it succeeds)."""
    if leader.req_pool_idx is None or leader.is_retracted:
        return False
    return not leader.times.first_token or leader.finished()
