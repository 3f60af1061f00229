"""Approximate prefix cache of each worker DP rank ("tenant"), for the ``cache_aware`` policy.

A prompt is cut into blocks of ``block_tokens`` token ids; block ``i`` is named by a hash chained over blocks
0..i, so one hash stands for a whole path from the root of a radix tree. Approximate on purpose: it models what the
node's radix cache likely holds, from routing decisions only.

    holders:  block hash -> bitmask of the tenants holding it (bit = the tenant's slot)
    lru[t]:   tenant t's block hashes, least recently routed first, each with the tenant's clock when last routed
    clock[t]: blocks routed to tenant t so far (``age``: how many were routed there after a given block)

Invariants: ``h in lru[t]`` <=> bit ``slot[t]`` of ``holders[h]`` is set; no ``holders`` value is 0;
``len(lru[t]) <= capacity(t)``. A tenant's capacity follows its node's KV pool (``set_capacity``: the node can
cache at most that many tokens), capped by ``max_blocks``; beyond it the tenant forgets blocks as the node evicts:
least recently used first, and a path's leaves before its root (a routed path is touched leaf first, so its root is
the most recent), so a matchable prefix never loses its head while keeping its tail.

``match`` walks the prompt's blocks once for all tenants (an AND of bitmasks per block): its cost grows with the
matched depth, not with the number of tenants times the prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(ids: Sequence[int], block_tokens: int, max_blocks: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``ids`` (at most ``max_blocks``: no tenant can hold more)."""
    out: list[int] = []
    h = 0
    end = len(ids) - block_tokens + 1
    if max_blocks is not None:
        end = min(end, max_blocks * block_tokens)
    for start in range(0, end, block_tokens):
        h = hash((h, *ids[start : start + block_tokens]))
        out.append(h)
    return out


class PrefixIndex:
    def __init__(self, block_tokens: int, max_blocks: int) -> None:
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks  # per tenant, whatever its node reports
        self.holders: dict[int, int] = {}
        self.lru: dict[str, OrderedDict[int, int]] = {}
        self.slot: dict[str, int] = {}
        self.by_slot: dict[int, str] = {}
        self.capacity: dict[str, int] = {}
        self.clock: dict[str, int] = {}
        self._free_slots: list[int] = []

    def set_capacity(self, tenant: str, tokens: int) -> None:
        """The tenant's node can cache ``tokens`` prompt tokens (its KV pool): keep at most that many blocks."""
        cap = max(1, min(self.max_blocks, tokens // self.block_tokens))
        if self.capacity.get(tenant) != cap:
            self.capacity[tenant] = cap
            if tenant in self.lru:
                self._evict(tenant)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each tenant holds (tenants holding none are absent)."""
        holders = self.holders
        out: dict[str, int] = {}
        alive, depth = 0, 0
        for h in hashes:
            held = holders.get(h, 0)
            m = held if depth == 0 else alive & held
            if depth and m != alive:
                self._record(alive & ~m, depth, out)
            if not m:
                return out
            alive, depth = m, depth + 1
        if depth:
            self._record(alive, depth, out)
        return out

    def insert(self, tenant: str, hashes: Sequence[int]) -> None:
        """The tenant was sent a prompt with these blocks: it holds them now, as its most recently used."""
        lru = self.lru.get(tenant)
        if lru is None:
            lru = self.lru[tenant] = OrderedDict()
            slot = self._free_slots.pop() if self._free_slots else len(self.slot)
            self.slot[tenant], self.by_slot[slot] = slot, tenant
        bit = 1 << self.slot[tenant]
        holders = self.holders
        clock = self.clock.get(tenant, 0)
        for h in reversed(hashes):  # leaf first: the root ends most recent
            if h in lru:
                lru.move_to_end(h)
            else:
                holders[h] = holders.get(h, 0) | bit
            lru[h] = clock
            clock += 1
        self.clock[tenant] = clock
        self._evict(tenant)

    def age(self, tenant: str, h: int) -> int:
        """Blocks routed to ``tenant`` since block ``h`` was (the node evicts the oldest first); ``h`` is held."""
        return self.clock[tenant] - self.lru[tenant][h]

    def size(self, tenant: str) -> int:
        return len(self.lru.get(tenant, ()))

    def blocks(self) -> int:
        """Distinct blocks held by any tenant."""
        return len(self.holders)

    def remove_tenant(self, tenant: str) -> None:
        lru = self.lru.pop(tenant, None)
        self.capacity.pop(tenant, None)
        self.clock.pop(tenant, None)
        if lru is None:
            return
        slot = self.slot.pop(tenant)
        del self.by_slot[slot]
        self._free_slots.append(slot)
        for h in lru:
            self._drop(h, 1 << slot)

    def remove_tenant_prefix(self, prefix: str) -> None:
        for t in [t for t in self.lru if t.startswith(prefix)]:
            self.remove_tenant(t)

    def _evict(self, tenant: str) -> None:
        lru = self.lru[tenant]
        cap = self.capacity.get(tenant, self.max_blocks)
        bit = 1 << self.slot[tenant]
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            self._drop(h, bit)

    def _drop(self, h: int, bit: int) -> None:
        left = self.holders[h] & ~bit
        if left:
            self.holders[h] = left
        else:
            del self.holders[h]

    def _record(self, mask: int, depth: int, out: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            out[self.by_slot[low.bit_length() - 1]] = depth
            mask ^= low
