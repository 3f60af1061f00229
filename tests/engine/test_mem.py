"""Memory pools and prefix caches: allocator page accounting, radix tree behaviour, request lifecycles."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, cast

import pytest
import torch

from common.engine.mem import ChunkCache, RadixCache, ReqToTokenPool, TokenToKVPoolAllocator, TreeNode
from common.engine.req import Req


def slots_of(pages: list[int], ps: int) -> list[int]:
    return [p * ps + o for p in pages for o in range(ps)]


# -- ReqToTokenPool --------------------------------------------------------------------------------------------------
def test_req_to_token_pool_alloc_free() -> None:
    pool = ReqToTokenPool(4, 8)
    assert pool.req_to_token.shape == (4 + 1, 8) and pool.padding_row == 4 and pool.req_to_token.dtype == torch.int64
    assert pool.alloc(2) == [0, 1]
    assert pool.available_size() == 2
    assert pool.alloc(3) is None and pool.available_size() == 2
    pool.free(0)
    with pytest.raises(RuntimeError):
        pool.free(0)
    with pytest.raises(RuntimeError):
        pool.free([1, 1])
    assert pool.available_size() == 3
    pool.free([1])
    pool.clear()
    assert pool.alloc(4) == [0, 1, 2, 3]


# -- TokenToKVPoolAllocator ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ps", [1, 16])
def test_alloc_free_available(ps: int) -> None:
    a = TokenToKVPoolAllocator(num_pages=8, page_size=ps)
    assert a.size == 8 * ps and a.available_size() == 8 * ps and a.num_free_pages == 8
    x = a.alloc(2 * ps + 1)
    assert x is not None and x.dtype == torch.int64
    assert x.tolist() == slots_of([1, 2, 3], ps)[: 2 * ps + 1]  # lowest pages first, page 0 never
    assert a.num_free_pages == 5
    a.free(x)
    assert a.num_free_pages == 8
    a.free(torch.empty(0, dtype=torch.int64))
    assert a.num_free_pages == 8
    a.clear()
    y = a.alloc(ps)
    assert y is not None and y.tolist() == slots_of([1], ps)


def test_free_whole_page_once() -> None:
    ps = 4
    a = TokenToKVPoolAllocator(num_pages=4, page_size=ps)
    x = a.alloc(8)
    assert x is not None
    a.free(x[5:6])  # any slot of page 2 frees the whole page
    assert a.num_free_pages == 3
    with pytest.raises(RuntimeError):
        a.free(x[4:5])  # page 2 again
    with pytest.raises(RuntimeError):
        a.free(torch.tensor([0, 1]))  # the padding page
    with pytest.raises(RuntimeError):
        a.free(x[:8])  # page 1 is allocated but page 2 is not: nothing freed
    assert a.num_free_pages == 3
    a.free(torch.cat([x[:4], x[:2]]))  # duplicates within one call are one page
    assert a.num_free_pages == 4
    with pytest.raises(RuntimeError):
        a.free(x[:1])


def test_alloc_extend_page_boundaries() -> None:
    ps = 16
    a = TokenToKVPoolAllocator(num_pages=10, page_size=ps)
    # Two fresh requests: 20 tokens (pages 1, 2) and 16 tokens (page 3), concatenated in order.
    x = a.alloc_extend([0, 0], [20, 16], [-1, -1])
    assert x is not None
    assert x.tolist() == slots_of([1], ps) + slots_of([2], ps)[:4] + slots_of([3], ps)
    # Continue request 0 from position 20: fills page 2 (offsets 4..15) then a fresh page 4.
    # Request 1 is page-aligned (16): its last_loc is ignored and it starts a fresh page 5.
    y = a.alloc_extend([20, 16], [40, 18], [int(x[19]), 999])
    assert y is not None
    assert y.tolist() == slots_of([2], ps)[4:] + slots_of([4], ps)[:8] + slots_of([5], ps)[:2]
    assert a.num_free_pages == 5
    # Extend inside the partial page only: no page taken.
    z = a.alloc_extend([40], [42], [int(y[-3])])
    assert z is not None and z.tolist() == [4 * ps + 8, 4 * ps + 9]
    assert a.num_free_pages == 5
    assert a.alloc_extend([0], [0], [-1]).tolist() == []  # type: ignore[union-attr]


def test_alloc_extend_page_size_1() -> None:
    a = TokenToKVPoolAllocator(num_pages=10, page_size=1)
    x = a.alloc_extend([0, 3], [4, 5], [-1, 7])
    assert x is not None and x.tolist() == [1, 2, 3, 4, 5, 6]
    assert a.available_size() == 4


@pytest.mark.parametrize("ps", [1, 16])
def test_alloc_decode(ps: int) -> None:
    a = TokenToKVPoolAllocator(num_pages=10, page_size=ps)
    x = a.alloc_extend([0, 0], [ps, ps - 1 if ps > 1 else 1], [-1, -1])
    assert x is not None and a.num_free_pages == 8
    last0, last1 = int(x[ps - 1]), int(x[-1])
    # Request 0 ended a page: fresh page. Request 1 has room in its page (when ps > 1).
    y = a.alloc_decode([ps + 1, ps if ps > 1 else 2], [last0, last1])
    assert y is not None
    if ps == 1:
        assert y.tolist() == [3, 4] and a.num_free_pages == 6
    else:
        assert y.tolist() == [3 * ps, last1 + 1] and a.num_free_pages == 7
        z = a.alloc_decode([ps + 2], [int(y[0])])
        assert z is not None and z.tolist() == [3 * ps + 1] and a.num_free_pages == 7


@pytest.mark.parametrize("ps", [1, 4])
def test_out_of_memory_allocates_nothing(ps: int) -> None:
    a = TokenToKVPoolAllocator(num_pages=3, page_size=ps)
    x = a.alloc(2 * ps)
    assert x is not None
    assert a.alloc(2 * ps) is None
    assert a.alloc_extend([0, 0], [ps, 1], [-1, -1]) is None
    assert a.alloc_decode([1, 1], [-1, -1]) is None
    assert a.num_free_pages == 1
    state = a.backup_state()
    assert a.alloc(ps) is not None and a.num_free_pages == 0
    a.restore_state(state)
    assert a.num_free_pages == 1
    a.free(x)
    assert a.num_free_pages == 3


# -- RadixCache ------------------------------------------------------------------------------------------------------
def make_cache(ps: int, num_pages: int = 64, num_reqs: int = 8) -> RadixCache:
    return RadixCache(ReqToTokenPool(num_reqs, 256), TokenToKVPoolAllocator(num_pages, ps), ps)


def insert_fresh(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert ``key`` on freshly allocated slots (freeing whatever part was already cached); returns its slots."""
    slots = cache.token_to_kv_pool_allocator.alloc(len(key))
    assert slots is not None
    n = cache.insert(key, slots)
    cache.token_to_kv_pool_allocator.free(slots[:n])
    return slots


def test_radix_match_insert_split() -> None:
    c = make_cache(1)
    s1 = insert_fresh(c, [1, 2, 3, 4, 5])
    assert c.insert([1, 2, 3, 4, 5], s1) == 5
    s2 = insert_fresh(c, [1, 2, 3, 9, 9])  # splits [1..5] after 3
    assert c.total_size() == 7 and c.evictable_size() == 7
    m = c.match_prefix([1, 2, 3, 9, 9, 7])
    assert m.device_indices.tolist() == s1[:3].tolist() + s2[3:].tolist()
    assert m.last_node is not None and m.last_node.key == [9, 9]
    m = c.match_prefix([1, 2, 8])
    assert m.device_indices.tolist() == s1[:2].tolist()
    assert m.last_node is not None and m.last_node.key == [1, 2]  # matching inside a node splits it
    assert c.match_prefix([7]).device_indices.numel() == 0
    assert c.match_prefix([]).last_node is c.root_node
    assert len(c.root_node.children) == 1 and c.total_size() == 7
    assert "len=" in c.pretty_print()


@pytest.mark.parametrize("ps", [4, 16])
def test_radix_page_aligned(ps: int) -> None:
    c = make_cache(ps)
    a = c.token_to_kv_pool_allocator
    key = list(range(100, 100 + 2 * ps + 3))
    slots = a.alloc(len(key))
    assert slots is not None
    assert c.insert(key, slots) == 0
    assert c.total_size() == 2 * ps  # the unaligned tail is not cached
    m = c.match_prefix([*key[: ps + 2], 0])
    assert m.device_indices.tolist() == slots[:ps].tolist()
    # A key that diverges inside the second page matches only the first page and splits on the boundary.
    other = [*key[: ps + 1], -1, *key[ps + 2 : 2 * ps]]
    m = c.match_prefix(other)
    assert len(m.device_indices) == ps and m.last_node is not None and len(m.last_node.key) == ps
    slots2 = a.alloc(2 * ps)
    assert slots2 is not None
    assert c.insert(other, slots2) == ps
    assert c.total_size() == 3 * ps
    assert all(len(n.key) % ps == 0 for n in c._nodes())
    assert c.match_prefix(other).device_indices.tolist() == slots[:ps].tolist() + slots2[ps:].tolist()


def test_lock_ref_protects_and_lru_order() -> None:
    ps = 4
    c = make_cache(ps, num_pages=16)
    a = c.token_to_kv_pool_allocator
    insert_fresh(c, [1] * 8)
    sb = insert_fresh(c, [2] * 8)
    insert_fresh(c, [3] * 4)
    assert a.num_free_pages == 16 - 5
    node_b = c.match_prefix([2] * 8).last_node  # b is now the most recently used
    assert c.inc_lock_ref(node_b) == -8
    assert c.evictable_size() == 12 and c.protected_size() == 8
    # LRU: a (oldest) then c; b is locked.
    assert c.evict(1) == 8
    assert c.match_prefix([1] * 8).device_indices.numel() == 0
    assert a.num_free_pages == 16 - 3
    assert c.evict(100) == 4
    assert c.match_prefix([3] * 4).device_indices.numel() == 0
    assert c.match_prefix([2] * 8).device_indices.tolist() == sb.tolist()
    assert a.num_free_pages == 16 - 2 and c.total_size() == 8
    assert c.dec_lock_ref(node_b) == 8
    with pytest.raises(RuntimeError):
        c.dec_lock_ref(node_b)
    assert c.evict(8) == 8 and a.num_free_pages == 16 and c.total_size() == 0


def test_evict_frees_exactly_leaf_pages() -> None:
    ps = 4
    c = make_cache(ps, num_pages=16)
    a = c.token_to_kv_pool_allocator
    base = insert_fresh(c, list(range(8)))  # pages 1, 2
    x = insert_fresh(c, [*range(8), 50, 51, 52, 53])  # page 5 (pages 3, 4 were duplicates: freed)
    y = insert_fresh(c, [*range(8), 60, 61, 62, 63])
    assert c.total_size() == 16 and a.num_free_pages == 12
    locked = c.match_prefix([*range(8), 60, 61, 62, 63]).last_node
    c.inc_lock_ref(locked)
    assert c.evict(1) == 4  # only leaf x can go: base is an ancestor of a locked leaf
    assert c.evict(100) == 0
    # Everything allocatable now is exactly "all pages but base's two and y's last".
    rest = a.alloc(a.available_size())
    assert rest is not None
    held = {int(s) // ps for s in [*base.tolist(), *y[8:].tolist()]}
    assert set((rest // ps).tolist()) == set(range(1, 17)) - held
    assert int(x[8]) // ps not in held
    a.free(rest)
    c.dec_lock_ref(locked)
    assert c.evict(100) == 12 and a.num_free_pages == 16


# -- request lifecycle -----------------------------------------------------------------------------------------------
class Sim:
    """A tiny scheduler: admits, prefills (chunked), decodes and finishes requests against one prefix cache.

    ``kv_tok[slot]`` records which token's KV the slot holds, so cached prefixes can be checked for correctness.
    """

    def __init__(self, ps: int, num_pages: int, radix: bool = True, num_reqs: int = 8) -> None:
        self.ps = ps
        self.r2t = ReqToTokenPool(num_reqs, 512)
        self.alloc = TokenToKVPoolAllocator(num_pages, ps)
        self.cache: RadixCache | ChunkCache = (
            RadixCache(self.r2t, self.alloc, ps) if radix else ChunkCache(self.r2t, self.alloc, ps)
        )
        self.kv_tok = torch.full(((num_pages + 1) * ps,), -1, dtype=torch.int64)
        self.live: list[Req] = []

    def admit(self, rid: str, ids: list[int]) -> Req | None:
        req = Req(rid, ids, cast(Any, None))
        req.init_next_round_input(self.cache)
        n = len(req.prefix_indices)
        assert n % self.ps == 0 and n < len(ids)
        assert self.kv_tok[req.prefix_indices].tolist() == ids[:n]  # cached KV is the right tokens' KV
        idx = self.r2t.alloc(1)
        if idx is None:
            return None
        self.cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = idx[0]
        self.r2t.write(idx[0], 0, req.prefix_indices)
        req.kv_committed_len = n
        req.cached_tokens = n
        self.live.append(req)
        return req

    def _alloc(self, fn: Any, need: int) -> torch.Tensor | None:
        out = fn()
        if out is None:
            self.cache.evict(need)
            out = fn()
        return out

    def _commit(self, req: Req, start: int, slots: torch.Tensor) -> None:
        assert req.req_pool_idx is not None
        pos = torch.arange(start, start + len(slots))
        assert torch.equal(slots % self.ps, pos % self.ps)  # position alignment
        self.r2t.write(req.req_pool_idx, start, slots)
        self.kv_tok[slots] = torch.tensor(req.all_ids()[start : start + len(slots)], dtype=torch.int64)
        req.kv_committed_len = start + len(slots)

    def step(self, req: Req, chunk: int, rng: random.Random) -> bool:
        """Prefill the next chunk, or decode one token. False when out of memory."""
        assert req.req_pool_idx is not None
        row = self.r2t.req_to_token[req.req_pool_idx]
        start = req.kv_committed_len
        last = int(row[start - 1]) if start > 0 else -1
        n_in = len(req.origin_input_ids)
        if start < n_in:  # prefill
            end = min(n_in, start + chunk)
            slots = self._alloc(
                lambda: self.alloc.alloc_extend([start], [end], [last]), end - start + self.ps
            )
            if slots is None:
                return False
            self._commit(req, start, slots)
            if end < n_in:
                self.cache.cache_unfinished_req(req)
                assert torch.equal(req.prefix_indices, row[:end])
                req.init_next_round_input(None)
                assert req.extend_input_len == len(req.fill_ids) - end
            else:
                req.output_ids.append(rng.randrange(50))
            return True
        seq_len = req.seqlen  # decode: the newest output token gets its KV
        slots = self._alloc(lambda: self.alloc.alloc_decode([seq_len], [last]), self.ps)
        if slots is None:
            return False
        self._commit(req, seq_len - 1, slots)
        req.output_ids.append(rng.randrange(50))
        return True

    def finish(self, req: Req, is_insert: bool = True) -> None:
        self.cache.cache_finished_req(req, is_insert=is_insert)
        assert req.req_pool_idx is None
        self.live.remove(req)

    def check(self) -> None:
        ps, c = self.ps, self.cache
        tree_pages: set[int] = set()
        if isinstance(c, RadixCache):
            nodes = c._nodes()
            for node in nodes:
                assert len(node.key) % ps == 0 and len(node.key) > 0
                assert self.kv_tok[node.value].tolist() == node.key
                tree_pages |= set((node.value // ps).tolist())
            assert len(tree_pages) * ps == c.total_size() == c.evictable_size() + c.protected_size()
            locks: Counter[int] = Counter()
            for req in self.live:
                node = req.last_node
                while node is not None and node is not c.root_node:
                    locks[node.id] += 1
                    node = node.parent
            assert {n.id: n.lock_ref for n in nodes if n.lock_ref} == dict(locks)
            assert c.protected_size() == sum(len(n.key) for n in nodes if n.lock_ref)
        owned = 0
        seen: set[int] = set()
        for req in self.live:
            assert req.req_pool_idx is not None
            row = self.r2t.req_to_token[req.req_pool_idx, : req.kv_committed_len]
            assert self.kv_tok[row].tolist() == req.all_ids()[: req.kv_committed_len]
            own = set((row // ps).tolist()) - tree_pages
            assert not own & seen  # no page is owned by two requests
            seen |= own
            owned += len(own)
        assert self.alloc.num_free_pages + len(tree_pages) + owned == self.alloc.num_pages
        assert self.r2t.available_size() + len(self.live) == self.r2t.size


@pytest.mark.parametrize("ps", [1, 4])
def test_cache_finished_and_unfinished_bookkeeping(ps: int) -> None:
    sim = Sim(ps, num_pages=64 // ps * 2)
    c = sim.cache
    assert isinstance(c, RadixCache)
    rng = random.Random(0)
    prompt = list(range(1, 23))  # 22 tokens
    a = sim.admit("a", prompt)
    assert a is not None and len(a.prefix_indices) == 0
    assert sim.step(a, 10, rng)  # chunk [0, 10): 10 // ps * ps cached, the rest stays a's own tail
    assert c.total_size() == 10 // ps * ps and c.protected_size() == c.total_size()
    assert a.last_node is not None and a.last_node.lock_ref == 1
    assert len(a.prefix_indices) == 10
    sim.check()
    # A second request with the same prompt shares the cached chunk while a is still prefilling.
    b = sim.admit("b", prompt)
    assert b is not None and len(b.prefix_indices) == 10 // ps * ps
    while len(b.output_ids) < 3:
        assert sim.step(b, 64, rng)
    sim.check()
    while len(a.output_ids) < 2:
        assert sim.step(a, 10, rng)
    sim.check()
    free_before = sim.alloc.num_free_pages
    sim.finish(b)  # caches prompt + 2 decoded tokens (the newest output token has no KV)
    assert c.total_size() == (22 + 2) // ps * ps
    assert c.match_prefix(b.all_ids()).device_indices.numel() == (22 + 2) // ps * ps
    sim.check()
    sim.finish(a)  # a's prompt pages are duplicates of b's: freed
    assert sim.alloc.num_free_pages > free_before
    assert c.protected_size() == 0 and sim.r2t.available_size() == sim.r2t.size
    sim.check()
    total = c.total_size()
    assert total == c.evictable_size() >= 24 // ps * ps
    assert c.evict(10**6) == total
    assert sim.alloc.num_free_pages == sim.alloc.num_pages


def test_chunk_cache_lifecycle() -> None:
    sim = Sim(4, num_pages=32, radix=False)
    rng = random.Random(0)
    a = sim.admit("a", list(range(30)))
    assert a is not None
    assert sim.step(a, 12, rng)
    assert torch.equal(a.prefix_indices, sim.r2t.req_to_token[a.req_pool_idx, :12])  # type: ignore[index]
    assert a.last_node is None
    while len(a.output_ids) < 5:
        assert sim.step(a, 12, rng)
    sim.check()
    assert sim.admit("b", list(range(30))).prefix_indices.numel() == 0  # type: ignore[union-attr]
    assert sim.cache.evict(100) == 0 and sim.cache.total_size() == 0
    for req in list(sim.live):
        sim.finish(req)
    assert sim.alloc.num_free_pages == 32 and sim.r2t.available_size() == sim.r2t.size


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_random_lifecycles_keep_pages_accounted(ps: int, seed: int, radix: bool) -> None:
    rng = random.Random(seed * 100 + ps)
    num_pages = 480 // ps
    sim = Sim(ps, num_pages, radix=radix, num_reqs=6)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(1, 80))] for _ in range(4)]
    next_id = 0
    for _ in range(300):
        action = rng.random()
        if action < 0.25 and len(sim.live) < sim.r2t.size:
            base = rng.choice(bases)
            ids = base[: rng.randrange(len(base) + 1)] + [
                rng.randrange(50) for _ in range(rng.randrange(1, 40))
            ]
            sim.admit(f"r{next_id}", ids)
            next_id += 1
        elif action < 0.85 and sim.live:
            req = rng.choice(sim.live)
            if not sim.step(req, rng.choice([3, 8, 16, 64]), rng):
                sim.finish(req, is_insert=False)  # out of memory even after eviction: abort
            elif len(req.output_ids) > rng.randrange(2, 30):
                sim.finish(req)
        elif action < 0.95 and sim.live:
            req = rng.choice(sim.live)
            sim.finish(req, is_insert=rng.random() < 0.8)
        else:
            sim.cache.evict(rng.randrange(1, 64))
        sim.check()
    for req in list(sim.live):
        sim.finish(req)
        sim.check()
    sim.cache.evict(10**9)
    assert sim.cache.total_size() == 0 and sim.cache.evictable_size() == 0
    assert sim.alloc.num_free_pages == num_pages
    assert sim.r2t.available_size() == sim.r2t.size


def test_tree_node_ordering_is_lru() -> None:
    a, b = TreeNode(), TreeNode()
    assert a < b
    a.touch()
    assert b < a


def test_held_prefix_cache_keeps_only_what_requests_hold() -> None:
    """A decode node's prompt cache: a landed prompt's full pages join it (a second copy landing later is folded
    into the first, its pages freed), a finished request's KV is never inserted, and the last unlock frees at once."""
    from common.engine.mem.held_prefix_cache import HeldPrefixCache

    ps = 4
    alloc = TokenToKVPoolAllocator(32, ps)
    cache = HeldPrefixCache(ReqToTokenPool(4, 64), alloc, ps)
    pool, full = cache.req_to_token_pool, alloc.available_size()
    prompt = list(range(100, 110))  # 2 full pages shared, 2 tokens on each request's own page
    reqs = []
    for i in range(2):
        req = Req(f"r{i}", prompt, cast(Any, None))
        req.req_pool_idx = pool.alloc(1)[0]  # type: ignore[index]
        pool.write(req.req_pool_idx, 0, alloc.alloc_extend([0], [len(prompt)], [-1]))  # type: ignore[arg-type]
        req.kv_committed_len = len(prompt)
        reqs.append(req)
    used = full - alloc.available_size()
    for req in reqs:
        cache.cache_prompt(req, 8)
    assert full - alloc.available_size() == used - 8, "the second copy of the full pages was not freed"
    rows = pool.req_to_token
    assert rows[reqs[0].req_pool_idx, :8].equal(rows[reqs[1].req_pool_idx, :8])
    assert cache.protected_size() == 8 and cache.evictable_size() == 0
    reqs[0].output_ids = [1, 2, 3, 4, 5, 6]
    reqs[0].kv_committed_len = len(prompt) + 5
    pool.write(reqs[0].req_pool_idx, len(prompt), alloc.alloc_extend([10], [15], [rows[reqs[0].req_pool_idx, 9]]))
    cache.cache_finished_req(reqs[0])  # not inserted; the shared pages stay for r1
    assert cache.total_size() == 8 and cache.protected_size() == 8
    cache.cache_finished_req(reqs[1])
    assert cache.total_size() == 0 and alloc.available_size() == full and pool.available_size() == pool.size
