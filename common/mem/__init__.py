"""Memory pools and prefix caches: request slots, paged KV slots, the radix tree."""

from common.mem.allocator import TokenToKVPoolAllocator
from common.mem.chunk_cache import ChunkCache
from common.mem.kv_pool import MHATokenToKVPool
from common.mem.radix_cache import BasePrefixCache, MatchResult, RadixCache, TreeNode
from common.mem.req_to_token_pool import ReqToTokenPool

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
