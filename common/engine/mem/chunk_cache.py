"""The prefix cache used with ``--disable-radix-cache``: nothing is shared, each request owns all its KV.

Same interface as ``RadixCache`` so the scheduler never branches on it: ``match_prefix`` finds nothing,
``cache_unfinished_req`` keeps a chunked request's slots as its prefix, ``cache_finished_req`` frees them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.engine.mem.allocator import TokenToKVPoolAllocator
from common.engine.mem.radix_cache import BasePrefixCache, MatchResult, TreeNode, _req_slot
from common.engine.mem.req_to_token_pool import ReqToTokenPool

if TYPE_CHECKING:
    from common.engine.req import Req


class ChunkCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = True

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(
            torch.empty(0, dtype=torch.int64, device=self.token_to_kv_pool_allocator.device), None
        )

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        return 0

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        idx = _req_slot(req)
        self.token_to_kv_pool_allocator.free(self.req_to_token_pool.req_to_token[idx, : req.kv_committed_len])
        self.req_to_token_pool.free(idx)
        req.req_pool_idx = None
        req.last_node = None

    def cache_unfinished_req(self, req: Req) -> None:
        idx = _req_slot(req)
        req.prefix_indices = self.req_to_token_pool.req_to_token[idx, : req.kv_committed_len].clone()

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def pretty_print(self) -> str:
        return ""
