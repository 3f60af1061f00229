"""``HostTierTree``: the radix tree whose nodes may live on the host only (``tree``): its host-side walks.

    alloc_host      host pages, evicting the least recently used host-only leaves when the pool is full
    evict_host      that eviction (a leaf whose last host copy goes leaves the tree)
    insert_host     pages read from storage join the tree as host-only nodes
    _delete_subtree a node and what hangs below it leave the tree, every tier's pages freed

``BackupTree`` builds on it with device -> host copies and device eviction, ``HiRadixCache`` on that with the rest
of the device side (matching, write policies, loads) and splits nodes on every tier (``_split_node``).
"""

from __future__ import annotations

import heapq

import torch

from common.engine.mem.hicache.host_pool import HostKVPool
from common.engine.mem.hicache.stats import HiCacheStats
from common.engine.mem.hicache.tree import HiTreeNode
from common.engine.mem.radix_cache import RadixCache


class HostTierTree(RadixCache):
    host_pool: HostKVPool
    stats: HiCacheStats

    def insert_host(self, prefix: list[int], tokens: list[int], host_pages: torch.Tensor, keys: list[bytes]) -> int:
        """Pages read from storage join the tree as host-only nodes below ``prefix`` (still in the tree, any tier);
        pages the tree has already are given to a node without a host copy or freed. Returns the tokens that
        joined as new nodes."""
        node, key = self.root_node, prefix
        while key:
            child = node.children.get(self._child_key(key))
            n = self._key_match(child.key, key) if child is not None else 0
            if child is None or n == 0:  # the path was evicted meanwhile: the pages have nowhere to hang
                self.host_pool.free(host_pages)
                return 0
            node, key = (self._split_node(child, n) if n < len(child.key) else child), key[n:]
        ps = self.page_size
        while tokens and (child := node.children.get(self._child_key(tokens))) is not None:
            n = self._key_match(child.key, tokens)
            if n < len(child.key):
                child = self._split_node(child, n)
            if child.ready and child.host_pages is None:
                child.host_pages = host_pages[: n // ps]
            else:
                self.host_pool.free(host_pages[: n // ps])
            node, tokens, host_pages, keys = child, tokens[n:], host_pages[n // ps:], keys[n // ps:]
        if tokens:
            new = HiTreeNode()
            new.parent, new.key, new.value = node, list(tokens), None
            new.host_pages, new.page_hashes = host_pages, list(keys)
            node.children[self._child_key(tokens)] = new
        return len(tokens)

    def _delete_subtree(self, x: HiTreeNode) -> None:
        """Drop ``x`` and its (host-only) descendants from the tree, freeing their pages."""
        stack = [x]
        while stack:
            y = stack.pop()
            stack.extend(y.children.values())
            if y.backup is not None:
                y.backup.wait()  # the write still reads its device pages and fills its host pages
                y.backup = None
            if y.value is not None:
                self.token_to_kv_pool_allocator.free(y.value)
                self.evictable_size_ -= len(y.key)
                y.value = None
            if y.host_pages is not None:
                self.host_pool.free(y.host_pages)
                y.host_pages = None
        assert x.parent is not None
        del x.parent.children[self._child_key(x.key)]
        x.parent = None

    def alloc_host(self, num_pages: int) -> torch.Tensor | None:
        pages = self.host_pool.alloc(num_pages)
        if pages is None:
            self.evict_host(num_pages - self.host_pool.available_pages)
            pages = self.host_pool.alloc(num_pages)
        return pages

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` host pages: least recently used host-only leaves first."""
        leaves = [x for x in self._nodes() if self._host_leaf(x)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            x = heapq.heappop(leaves)
            parent = x.parent
            freed += len(x.host_pages)  # type: ignore[arg-type]
            self._delete_subtree(x)
            if parent is not None and parent is not self.root_node and self._host_leaf(parent):
                heapq.heappush(leaves, parent)
        self.stats.host_evicted_pages += freed
        return freed

    @staticmethod
    def _host_leaf(x: HiTreeNode) -> bool:
        return x.host_only and not x.children and x.lock_ref == 0 and x.host_ref == 0
