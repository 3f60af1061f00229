"""Memory pools and prefix caches: allocator page accounting, radix tree behaviour (lifecycles: test_mem_lifecycle)."""

from __future__ import annotations

import pytest
import torch

from common.engine.mem import RadixCache, ReqToTokenPool, TokenToKVPoolAllocator


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
