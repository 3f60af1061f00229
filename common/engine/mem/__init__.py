"""Memory pools and prefix caches: request slots, paged KV slots, the radix tree."""

from common.engine.mem.allocator import TokenToKVPoolAllocator
from common.engine.mem.chunk_cache import ChunkCache
from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.mem.radix_cache import BasePrefixCache, MatchResult, RadixCache, TreeNode
from common.engine.mem.req_to_token_pool import ReqToTokenPool

__all__ = [
    "BasePrefixCache",
    "ChunkCache",
    "MHATokenToKVPool",
    "MatchResult",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
]
