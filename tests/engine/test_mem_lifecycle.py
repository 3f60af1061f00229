"""Memory pools and prefix caches over whole request lifecycles: every page accounted for after any sequence of
prefills, chunks, finishes and evictions (radix and chunk caches), and the decode node's held-prefix cache."""


from __future__ import annotations

import random
from collections import Counter
from typing import Any, cast

import pytest
import torch

from common.engine.mem import ChunkCache, RadixCache, ReqToTokenPool, TokenToKVPoolAllocator, TreeNode
from common.engine.req import Req


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
