"""Approximate prefix cache of each worker (or worker DP rank), for the ``cache_aware`` policy.

A prompt is cut into blocks of ``block_tokens`` token ids; block ``i`` is named by a hash chained over blocks
0..i, so one hash stands for a whole path from the root of a radix tree. Each tenant keeps an LRU set of the block
hashes routed to it, bounded by ``max_blocks``. ``match`` counts the leading blocks of a prompt a tenant holds.
Approximate on purpose: it models what the node's radix cache likely holds, from routing decisions only, and forgets
in LRU order as the node would evict.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(ids: Sequence[int], block_tokens: int) -> list[int]:
    out: list[int] = []
    h = 0
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        h = hash((h, *ids[start : start + block_tokens]))
        out.append(h)
    return out


class PrefixIndex:
    def __init__(self, block_tokens: int, max_blocks: int) -> None:
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self.tenants: dict[str, OrderedDict[int, None]] = {}

    def match(self, tenant: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` the tenant holds."""
        blocks = self.tenants.get(tenant)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, tenant: str, hashes: Sequence[int]) -> None:
        blocks = self.tenants.setdefault(tenant, OrderedDict())
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def size(self, tenant: str) -> int:
        return len(self.tenants.get(tenant, ()))

    def remove_tenant_prefix(self, prefix: str) -> None:
        for t in [t for t in self.tenants if t.startswith(prefix)]:
            del self.tenants[t]
