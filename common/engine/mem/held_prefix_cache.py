"""The decode node's prefix cache: a radix tree that holds only pages some request holds (SGLang has none there).

A decode node receives every prompt's KV from its prefill node. Requests with the same prompt (the choices of one
``n > 1`` request) share the prompt's full pages: the first one's pages join this tree when its KV has landed
(``cache_prompt``), and a later one matches them at preallocation, locks them and receives only the rest
(``decode_node.prealloc_queue``)::

    choice 0:  [p1 p2 p3 | p4.]  transferred whole; on landing p1..p3 join the tree, locked by choice 0
    choice 1:  [p1 p2 p3 | q4.]  p1..p3 matched and locked; only q4 (the partial last page) is transferred
    ...        a finish, retraction or abort unlocks; the last unlock frees p1..p3

Invariants (on top of ``RadixCache``'s):
- Whenever control leaves this class, every node is locked (``lock_ref > 0``): a node whose last lock goes is
  freed at once (``evictable_size() == 0``), so the node's free page count is what it was without sharing and
  every budget computed from ``allocator.available_size()`` stays exact.
- Only computed or landed pages are inserted (a prompt's landed full pages, a retracted request's recomputed
  chunks), never a page a batch may still write.
- A finished request's KV is never inserted (``cache_finished_req`` releases as ``is_insert=False``): only what
  another request holds is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine.mem.radix_cache import RadixCache, TreeNode, _req_slot

if TYPE_CHECKING:
    from common.engine.req import Req


class HeldPrefixCache(RadixCache):
    def cache_prompt(self, req: Req, num_tokens: int) -> None:
        """The request's first ``num_tokens`` prompt positions (page-aligned, their KV landed in its row) join the
        tree: its row then points at the tree's slots (its own duplicates of pages another request inserted first
        are freed) and it locks their path (``req.last_node``)."""
        if num_tokens % self.page_size:
            raise ValueError(f"cache_prompt: {num_tokens} tokens is not a whole number of pages")
        idx = _req_slot(req)
        row = self.req_to_token_pool.req_to_token[idx]
        cached = self._path_len(req.last_node)
        key = req.origin_input_ids[:num_tokens]
        new_prefix_len = self.insert(key, row[:num_tokens])
        self.token_to_kv_pool_allocator.free(row[cached:new_prefix_len])
        match = self.match_prefix(key)
        if len(match.device_indices) != num_tokens:
            raise RuntimeError(f"cache_prompt: re-match found {len(match.device_indices)} of {num_tokens}")
        self.req_to_token_pool.write(idx, cached, match.device_indices[cached:])
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.last_node = match.last_node

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        super().cache_finished_req(req, is_insert=False)

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        delta = super().dec_lock_ref(node)
        if self.evictable_size_:
            self.evict(self.evictable_size_)  # what nobody holds any more is freed at once
        return delta
