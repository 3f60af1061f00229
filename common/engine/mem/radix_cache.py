"""Prefix cache: a radix tree from token ids to the KV slots that hold them (SGLang's ``RadixCache``).

Tree shape (``page_size`` 4; every edge key and value is a whole number of pages)::

    root ──[1 2 3 4]── A ──[5 6 7 8 9 10 11 12]── B
                        └──[5 6 7 0]── C          value: int64 KV slots, one per key token

Invariants:
- With ``page_size > 1`` keys are matched and inserted in page-aligned lengths only, so nodes split on page
  boundaries and the tree owns whole pages; a request's unaligned tail stays with the request.
- ``node.lock_ref > 0`` for every node on the path of a running request's ``last_node``; locked nodes are never
  evicted. ``evictable_size_`` counts tokens of unlocked nodes, ``protected_size_`` tokens of locked ones.
- A request's KV (``req_to_token[req.req_pool_idx, :req.kv_committed_len]``) holds the KV of
  ``req.all_ids()[:req.kv_committed_len]`` (the newest output token usually has no KV yet). Its first
  ``cached_len`` slots (the path length of ``req.last_node``) are the tree's; the rest are the request's own.
  Every slot the allocator gave the request lies on a page that holds one of those committed slots.
- The scheduler calls ``inc_lock_ref(req.last_node)`` when it admits a request; ``cache_finished_req`` and
  ``cache_unfinished_req`` then own the lock.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.engine.mem.allocator import TokenToKVPoolAllocator
from common.engine.mem.req_to_token_pool import ReqToTokenPool

if TYPE_CHECKING:
    from common.engine.req import Req

_access_clock = itertools.count()  # logical LRU time: strictly increasing, so eviction order is deterministic


class TreeNode:
    _ids = itertools.count()

    def __init__(self) -> None:
        self.id = next(TreeNode._ids)
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: list[int] = []
        self.value: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access_time = next(_access_clock)

    def touch(self) -> None:
        self.last_access_time = next(_access_clock)

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True, slots=True)
class MatchResult:
    device_indices: torch.Tensor  # int64 KV slots of the matched prefix (page-aligned length)
    last_node: TreeNode | None  # deepest matched node; lock it to keep the prefix (None: no tree)


class BasePrefixCache(ABC):
    """What the scheduler needs from a prefix cache (radix tree, or ``ChunkCache`` when it is disabled)."""

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached (page-aligned) prefix of ``key``; refreshes its LRU time."""

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Add ``key`` -> ``value`` slots; returns how many leading tokens were already cached (slots not taken)."""

    @abstractmethod
    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Release a finished (or aborted, ``is_insert=False``) request: its KV goes to the cache or is freed,
        its lock is dropped, its request slot is freed and ``req.req_pool_idx`` set to None."""

    @abstractmethod
    def cache_unfinished_req(self, req: Req) -> None:
        """Between prefill chunks: cache the committed KV; ``req.prefix_indices`` = its committed slots."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` unlocked cached tokens (LRU leaves first) if possible; returns the count."""

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Protect ``node`` and its ancestors from eviction; returns the change in ``evictable_size()``."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Undo one ``inc_lock_ref``; returns the change in ``evictable_size()``."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Forget everything (does not free slots: pair it with ``allocator.clear()``)."""

    @abstractmethod
    def pretty_print(self) -> str: ...

    # -- the hierarchical cache's hooks (``common.engine.mem.hicache``); a one-tier cache has nothing to do ----------
    def check_hicache_events(self) -> None:  # noqa: B027  (optional: a default that does nothing)
        """Once per step, before batch admission: settle the copies between tiers that have finished."""

    def init_load_back(self, req: Req, mem_quota: int) -> bool:
        """After ``req.init_next_round_input``: start bringing the rest of its cached prefix back from a lower tier
        (host, storage) if ``mem_quota`` (``PrefillAdder.load_quota``) says it fits. True: it waits in the queue."""
        return False

    def release_retracted(self, req: Req) -> None:
        """A running request is retracted: give up its KV (``cache_finished_req``; a lower tier may keep a copy)."""
        self.cache_finished_req(req)

    def close(self) -> None:  # noqa: B027  (optional: a default that does nothing)
        """Stop the threads the cache runs (none here)."""


class RadixCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
        disable: bool = False,
    ) -> None:
        if page_size != token_to_kv_pool_allocator.page_size:
            raise ValueError(
                f"page_size {page_size} != allocator page_size {token_to_kv_pool_allocator.page_size}"
            )
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.device = token_to_kv_pool_allocator.device
        self.reset()

    # -- tree queries ----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.root_node = TreeNode()
        self.root_node.lock_ref = 1  # the root is never evicted
        self.evictable_size_ = 0
        self.protected_size_ = 0

    def match_prefix(self, key: list[int]) -> MatchResult:
        key = key[: self._aligned(len(key))]
        if self.disable or not key:
            return MatchResult(self._empty(), self.root_node)
        values: list[torch.Tensor] = []
        node = self.root_node
        node.touch()
        while key and (child := node.children.get(self._child_key(key))) is not None:
            child.touch()
            n = self._key_match(child.key, key)
            if n < len(child.key):
                node = self._split_node(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            key = key[n:]
        return MatchResult(torch.cat(values) if values else self._empty(), node)

    def peek_prefix(self, key: list[int]) -> tuple[int, TreeNode]:
        """Length of the cached (page-aligned) prefix of ``key`` and the deepest node wholly inside it.

        Read-only: no split, no LRU touch, no lock; what a scheduling policy asks of every waiting request.
        """
        key = key[: self._aligned(len(key))]
        node, matched = self.root_node, 0
        while not self.disable and key and (child := node.children.get(self._child_key(key))) is not None:
            n = self._key_match(child.key, key)
            matched += n
            if n < len(child.key):
                break
            node, key = child, key[n:]
        return matched, node

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        if self.disable:
            return 0
        n_aligned = self._aligned(len(key))
        key, value = key[:n_aligned], value[:n_aligned]
        node = self.root_node
        node.touch()
        matched = 0
        while key and (child := node.children.get(self._child_key(key))) is not None:
            child.touch()
            n = self._key_match(child.key, key)
            matched += n
            key, value = key[n:], value[n:]
            node = self._split_node(child, n) if n < len(child.key) else child
        if key:
            new = TreeNode()
            new.parent, new.key, new.value = node, list(key), value.clone()
            node.children[self._child_key(key)] = new
            self.evictable_size_ += len(key)
        return matched

    # -- request lifecycle -----------------------------------------------------------------------------------------
    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        idx = _req_slot(req)
        committed = req.kv_committed_len
        kv = self.req_to_token_pool.req_to_token[idx, :committed]
        alloc = self.token_to_kv_pool_allocator
        if self.disable:
            alloc.free(kv)
        else:
            cached = self._path_len(req.last_node)
            if is_insert:
                aligned = self._aligned(committed)
                new_prefix_len = self.insert(req.all_ids()[:aligned], kv[:aligned])
                # [cached, new_prefix_len): our duplicates of what the tree already holds; [aligned, ..): the tail.
                alloc.free(torch.cat([kv[cached:new_prefix_len], kv[aligned:]]))
            else:
                alloc.free(kv[cached:])
            self.dec_lock_ref(req.last_node)
        req.last_node = None
        self.req_to_token_pool.free(idx)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: Req) -> None:
        idx = _req_slot(req)
        committed = req.kv_committed_len
        row = self.req_to_token_pool.req_to_token[idx]
        if self.disable:
            req.prefix_indices = row[:committed].clone()
            return
        cached = self._path_len(req.last_node)
        # NOTE: under the overlap schedule the next decode step may already be launched (committed = fill + 1);
        # only the tokens known here are cached.
        aligned = self._aligned(min(committed, len(req.fill_ids)))
        token_ids = req.fill_ids[:aligned]
        new_prefix_len = self.insert(token_ids, row[:aligned])
        self.token_to_kv_pool_allocator.free(row[cached:new_prefix_len])
        match = self.match_prefix(token_ids)
        if len(match.device_indices) != aligned:
            raise RuntimeError(
                f"cache_unfinished_req: re-match found {len(match.device_indices)} of {aligned}"
            )
        # The row now points at the tree's slots for [0, aligned); [aligned, committed) stays the request's own.
        self.req_to_token_pool.write(idx, cached, match.device_indices[cached:])
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.prefix_indices = row[:committed].clone()

    # -- locking and eviction --------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode | None) -> int:
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root_node and node is not None:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root_node and node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node}")
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    def evict(self, num_tokens: int) -> int:
        if self.disable or num_tokens <= 0:
            return 0
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        evicted = 0
        while evicted < num_tokens and leaves:
            node = heapq.heappop(leaves)
            self.token_to_kv_pool_allocator.free(node.value)
            evicted += len(node.key)
            self.evictable_size_ -= len(node.key)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key)]
            node.parent = None
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return evicted

    # -- sizes and debugging ---------------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        return sum(len(n.key) for n in self._nodes())

    def all_values(self) -> torch.Tensor:
        """Every KV slot the tree holds (for invariant checks)."""
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else self._empty()

    def pretty_print(self) -> str:
        lines: list[str] = []
        stack = [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            if node is not self.root_node:
                head = " ".join(map(str, node.key[:8])) + (" ..." if len(node.key) > 8 else "")
                lines.append(f"{'  ' * depth}[{head}] len={len(node.key)} lock={node.lock_ref}")
            stack.extend((c, depth + 1) for c in node.children.values())
        lines.append(
            f"#tokens: {self.total_size()} evictable: {self.evictable_size_} protected: {self.protected_size_}"
        )
        text = "\n".join(lines)
        print(text)
        return text

    # -- internals -------------------------------------------------------------------------------------------------
    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _aligned(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def _child_key(self, key: list[int]) -> int | tuple[int, ...]:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _key_match(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of ``a`` and ``b``, rounded down to whole pages."""
        ps, n = self.page_size, min(len(a), len(b))
        if ps == 1:
            i = 0
            while i < n and a[i] == b[i]:
                i += 1
            return i
        i = 0
        while i + ps <= n and a[i : i + ps] == b[i : i + ps]:
            i += ps
        return i

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child`` after ``split_len`` tokens; returns the new upper node (same locks, same access time)."""
        parent = child.parent
        assert parent is not None
        new = TreeNode()
        new.parent, new.key, new.value = parent, child.key[:split_len], child.value[:split_len]
        new.lock_ref, new.last_access_time = child.lock_ref, child.last_access_time
        child.parent, child.key, child.value = new, child.key[split_len:], child.value[split_len:]
        new.children[self._child_key(child.key)] = child
        parent.children[self._child_key(new.key)] = new
        return new

    def _path_len(self, node: TreeNode | None) -> int:
        n = 0
        while node is not None and node is not self.root_node:
            n += len(node.key)
            node = node.parent
        return n

    def _nodes(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _req_slot(req: Req) -> int:
    if req.req_pool_idx is None:
        raise RuntimeError(f"{req} holds no request slot (already released?)")
    return req.req_pool_idx
