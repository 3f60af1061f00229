"""``PrefillAdder``: picks which waiting requests join the next prefill batch, under three budgets.

    rem_total_tokens  KV slots left after reserving the running requests' expected future tokens
                      (free + evictable - sum(remaining max_new_tokens * new_token_ratio))
    rem_input_tokens  prompt tokens this batch may compute (--max-prefill-tokens)
    rem_chunk_tokens  tokens left in this round's chunk (--chunked-prefill-size); a request that does not fit
                      is truncated to a page multiple and becomes the chunked request
"""

from __future__ import annotations

import enum
from typing import Any

from common.engine.req import Req

CLIP_MAX_NEW_TOKENS = 4096  # caps one request's reservation so a huge max_new_tokens cannot block admission


class AddReqResult(enum.Enum):
    CONTINUE = enum.auto()  # room for more
    NO_TOKEN = enum.auto()  # KV memory exhausted
    OTHER = enum.auto()  # input or chunk budget exhausted


def ceil_to(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


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
        if req.sits_out:  # the schedule policy keeps it out of this round (common.engine.schedule_order)
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
