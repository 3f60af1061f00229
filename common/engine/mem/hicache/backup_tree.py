"""``BackupTree``: the tree's device -> host copies of nodes and its device eviction (``HiRadixCache`` builds on it).

    write_backup    a node's device pages to new host pages (a write-through, or an eviction's own write)
    evict           device leaves, least recently used first: a node with a host copy stays, host-only; one without
                    is written first (``write_back``, or host-only children would hang from nothing), else dropped

An eviction's own write is the one copy a step waits for. Its nodes keep the host copy only if every rank's write
ended without error (``LoadWaits.settle_write``, one collective with TP); else they are dropped on every rank (the
prefix is recomputed when it comes back) and the host pages go once no rank's copy writes them. While a write given
up on still runs the write thread is behind it: evictions then write nothing (they drop what they would write).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.engine.mem.hicache.copy_engine import CopyEngine, CopyJob, Fence
from common.engine.mem.hicache.host_tree import HostTierTree
from common.engine.mem.hicache.load_waits import LoadWaits
from common.engine.mem.hicache.tree import HiTreeNode, device_pages

if TYPE_CHECKING:
    from common.engine.mem.hicache.storage_tier import StorageTier


class BackupTree(HostTierTree):
    copier: CopyEngine
    write_policy: str
    fence: Callable[[], Fence]
    storage: StorageTier | None
    waits: LoadWaits
    writing: list[tuple[CopyJob, list[HiTreeNode]]]

    def write_backup(self, nodes: list[HiTreeNode], lock: bool = False) -> CopyJob | None:
        """Copy ``nodes``' device pages to new host pages (one job); None when the host pool has no room. ``lock``:
        the nodes stay locked until the job has ended (``check_hicache_events``); else the caller waits for it."""
        fences = [f for x in nodes if (f := x.pending_fence()) is not None]
        fence = self.fence() if fences else None  # the batch launched last runs after theirs
        num = sum(len(x.key) for x in nodes) // self.page_size
        host = self.alloc_host(num)
        if host is None:
            return None
        dev = torch.cat([device_pages(x.value, self.page_size) for x in nodes])  # type: ignore[arg-type]
        keys = [k for x in nodes for k in (x.page_hashes or [])] if self.storage is not None else []
        then = self.storage.write_behind_hook(keys) if self.storage is not None and keys else None
        job = self.copier.write(dev, host, fence, then)
        offset = 0
        for x in nodes:
            pages = len(x.key) // self.page_size
            x.host_pages, x.backup = host[offset: offset + pages], job
            offset += pages
        if lock:
            for x in nodes:
                self.inc_lock_ref(x)
            self.writing.append((job, nodes))
        self.stats.track_write(job)
        return job

    def evict(self, num_tokens: int) -> int:
        if self.disable or num_tokens <= 0:
            return 0
        leaves = [x for x in self._nodes() if self._device_leaf(x)]
        heapq.heapify(leaves)
        gone: set[int] = set()
        keep, write, drop = [], [], []
        evicted = 0
        while evicted < num_tokens and leaves:
            x = heapq.heappop(leaves)
            x.settle_backup(self.host_pool.free)
            if x.backup is not None:  # a write still reads its pages (not a write-through: those are locked)
                continue
            # a host copy: keep the node host-only; none: write it first (write_back, or its host-only subtree
            # would hang from nothing), else drop it
            (keep if x.host_pages is not None else write if self.write_policy == "write_back" or x.children
             else drop).append(x)
            gone.add(x.id)
            evicted += len(x.key)
            parent = x.parent
            if parent is not self.root_node and self._device_leaf(parent, gone):
                heapq.heappush(leaves, parent)
        if write:
            job = None if self.waits.writes_stuck else self.write_backup(write)
            if job is not None and self._settle_write(job, write):
                keep += write
            else:
                drop += write
        for x in keep:
            x.backup = None  # ended without error: settled when picked, or the write above
            self.token_to_kv_pool_allocator.free(x.value)
            self.evictable_size_ -= len(x.key)
            x.value, x.fence = None, None
        for x in drop:
            self._delete_subtree(x)
        return evicted

    def _settle_write(self, job: CopyJob, nodes: list[HiTreeNode]) -> bool:
        """Whether ``nodes`` keep the host copy ``job`` wrote: it ended without error on every rank. If not, they
        lose it on every rank (its host pages go once no rank's copy writes them)."""
        host = torch.cat([x.host_pages for x in nodes])  # type: ignore[misc]
        if self.waits.settle_write(job, lambda: self.host_pool.free(host)):
            return True
        for x in nodes:
            x.host_pages, x.backup = None, None
        return False

    def _device_leaf(self, x: HiTreeNode, gone: set[int] = frozenset()) -> bool:  # type: ignore[assignment]
        return x.ready and x.lock_ref == 0 and x.id not in gone and not any(
            c.on_device and c.id not in gone for c in x.children.values())
