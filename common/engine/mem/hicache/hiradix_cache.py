"""``HiRadixCache``: the radix cache with a host tier under it (and a storage tier under that, ``storage_tier``).

The scheduler sees the ``RadixCache`` calls plus two (``BasePrefixCache``'s hooks)::

    check_hicache_events()        once per step: finished loads unlock their nodes, finished prefetches join the tree
    init_load_back(req, quota)    after a request's match: start loading its host-resident continuation (and a
                                  storage prefetch of what follows); True = the request waits in the queue, until
                                  the load ends or --hicache-load-timeout (``load_waits``)

Write policies (``--hicache-write-policy``): ``write_through`` copies a node to the host at insert,
``write_through_selective`` on its second hit, ``write_back`` when the device evicts it. A device eviction keeps a
node with a host copy (host-only now; ``tree``); without one, a leaf is dropped and a node with host-only children
is written first (``backup_tree``). The host pool evicts its least recently used host-only leaves.

Page ownership under copies (``copy_engine``): a write's device pages are those of a node the job backs up. A
write-through (``write_through``, ``write_through_selective``) locks its nodes until its job has ended on every rank
(``check_hicache_events``; SGLang's ``ongoing_write_through``): they are not evictable meanwhile, so no eviction
frees pages a write still reads, none waits for one inside a step, and admission never counts on their pages. Only
an eviction's own write (``write_back``, or a node with host-only children and no host copy) is waited for, its
outcome agreed over the TP group (``backup_tree``). A load's device pages belong to nodes locked until the job is
done (``check_hicache_events``); its host pages to those nodes (host eviction skips locked nodes). A load given up
on (past its deadline, or overtaken by an insert of the same tokens: no step waits for a load) leaves its nodes
host-only; its device pages are reserved until its copy can no longer write them (cancelled before it began to, or
ended: ``LoadWaits``). Every job waits for the batch in flight when it was submitted. With TP, a load's verdict
(done, failed, expired), a write-through's end and an eviction write's outcome are agreed over the group, so every
rank admits the same requests at the same step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.engine.distributed import TPGroup
from common.engine.io_struct import HiCacheLoad
from common.engine.mem.allocator import TokenToKVPoolAllocator
from common.engine.mem.hicache.backup_tree import BackupTree
from common.engine.mem.hicache.copy_engine import CopyEngine, CopyJob, Fence
from common.engine.mem.hicache.host_pool import HostKVPool
from common.engine.mem.hicache.load_waits import EXPIRED, OK, WAIT, LoadWaits
from common.engine.mem.hicache.stats import HiCacheStats
from common.engine.mem.hicache.tree import HiTreeNode, device_pages, split_tiers
from common.engine.mem.radix_cache import MatchResult
from common.engine.mem.req_to_token_pool import ReqToTokenPool

if TYPE_CHECKING:
    from common.engine.mem.hicache.storage_tier import StorageTier
    from common.engine.req import Req

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class LoadOp:
    job: CopyJob
    nodes: list[HiTreeNode]  # a path, top first; the last is locked (its ancestors with it)
    req: Req  # the request it was started for: its tokens count as that request's host (storage) hits
    host_tokens: int
    storage_tokens: int
    deadline: float


class HiRadixCache(BackupTree):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, page_size: int, *,
                 host_pool: HostKVPool, copier: CopyEngine, write_policy: str, fence: Callable[[], Fence],
                 tp: TPGroup, load_timeout: float, storage: StorageTier | None = None) -> None:
        self.host_pool = host_pool
        self.copier = copier
        self.write_policy = write_policy
        self.fence = fence
        self.tp = tp
        self.storage = storage
        self.waits = LoadWaits(tp, load_timeout)
        self.stats = HiCacheStats()
        self.ongoing_loads: list[LoadOp] = []
        self.writing: list[tuple[CopyJob, list[HiTreeNode]]] = []  # write-throughs in flight, their nodes locked
        self.fenced: list[HiTreeNode] = []  # nodes whose batch may still run (their fence is let go once it ran)
        super().__init__(req_to_token_pool, allocator, page_size)

    def reset(self) -> None:
        for job in [op.job for op in self.ongoing_loads] + [a.job for a in self.waits.abandoned] + [
                job for job, _ in self.writing]:
            job.wait()
        self.ongoing_loads, self.waits.abandoned, self.writing = [], [], []
        self.host_pool.clear()
        super().reset()
        self.root_node = HiTreeNode()
        self.root_node.lock_ref = 1

    def close(self) -> None:
        self.copier.close()
        if self.storage is not None:
            self.storage.close()

    # -- matching --------------------------------------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> MatchResult:
        """The longest prefix ready on the device (host-resident and loading nodes below it are not matched)."""
        key = key[: self._aligned(len(key))]
        node = self.root_node
        node.touch()
        values: list[torch.Tensor] = []
        while not self.disable and key and (child := node.children.get(self._child_key(key))) is not None:
            if not child.ready:
                break
            child.touch()
            self._hit(child)
            n = self._key_match(child.key, key)
            if n < len(child.key):
                node = self._split_node(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node, key = child, key[n:]
        return MatchResult(torch.cat(values) if values else self._empty(), node)

    def init_load_back(self, req: Req, mem_quota: int) -> bool:
        node = req.last_node
        if self.disable or node is None:
            return False
        key = req.fill_ids[: self._aligned(len(req.fill_ids) - 1)]
        rest = key[len(req.prefix_indices):]
        to_load: list[HiTreeNode] = []
        busy = False
        while rest and (child := node.children.get(self._child_key(rest))) is not None:
            if child.loading is not None:
                busy = True  # another request's load brings it back: wait for it
                break
            if child.on_device:
                break
            child.touch()
            n = self._key_match(child.key, rest)
            if n < len(child.key):
                child = self._split_node(child, n)
            to_load.append(child)
            node, rest = child, rest[n:]
        if busy:
            return True
        waits = self.storage is not None and self.storage.prefetch_waits(self, req, key, len(key) - len(rest), node)
        loads = bool(to_load) and not self.waits.stuck and self._load_back(req, to_load, mem_quota)
        return loads or waits

    def _load_back(self, req: Req, nodes: list[HiTreeNode], mem_quota: int) -> bool:
        """Start loading ``nodes`` (a host-only run below ``req.last_node``); False if it does not fit now."""
        n = sum(len(x.key) for x in nodes)
        if mem_quota <= 0:  # the request does not fit now, loaded or not: no pages for it yet
            return False
        ancestor = req.last_node
        self.inc_lock_ref(ancestor)  # the eviction below must not take the path the run hangs from
        for x in nodes:
            x.host_ref += 1
        if self.token_to_kv_pool_allocator.available_size() < n:
            self.evict(n - self.token_to_kv_pool_allocator.available_size())
        slots = self.token_to_kv_pool_allocator.alloc(n)
        for x in nodes:
            x.host_ref -= 1
        self.dec_lock_ref(ancestor)
        if slots is None:
            return False
        host = torch.cat([x.host_pages for x in nodes])  # type: ignore[misc]
        job = self.copier.load(host, device_pages(slots, self.page_size), self.fence())
        offset = 0
        for x in nodes:
            x.value, x.loading = slots[offset: offset + len(x.key)], job
            offset += len(x.key)
        self.evictable_size_ += n
        self.inc_lock_ref(nodes[-1])
        storage_tokens = min(n, self.storage.take_credit(req.rid) if self.storage is not None else 0)
        self.ongoing_loads.append(LoadOp(job, nodes, req, n - storage_tokens, storage_tokens, self.waits.deadline()))
        req.cached_tokens_storage += storage_tokens
        req.cached_tokens_host += n - storage_tokens
        return True

    # -- the step's events -----------------------------------------------------------------------------------------
    def check_hicache_events(self) -> None:
        if self.ongoing_loads or self.waits.settling or self.writing:
            ops, writes = self.ongoing_loads, self.writing
            verdicts, written = self.waits.poll([(op.job, op.deadline) for op in ops], [job for job, _ in writes])
            self.writing = [w for w, verdict in zip(writes, written, strict=True) if verdict == WAIT]
            for (job, nodes), verdict in zip(writes, written, strict=True):
                if verdict != WAIT:
                    self._written(job, nodes, verdict == OK)
            self.ongoing_loads = [op for op, verdict in zip(ops, verdicts, strict=True) if verdict == WAIT]
            for op, verdict in zip(ops, verdicts, strict=True):
                if verdict == EXPIRED:
                    logger.warning("a host -> device load of %d tokens ran past --hicache-load-timeout (%.1f s): its "
                                   "request computes them", op.host_tokens + op.storage_tokens, self.waits.timeout_s)
                    self.stats.timeouts += 1
                    self._abandon_load(op)
                elif verdict != WAIT:
                    self._finish_load(op, verdict == OK)
        if self.storage is not None:
            self.storage.settle(self)
        self.fenced = [x for x in self.fenced if x.pending_fence() is not None]  # drop the batches' futures

    def _written(self, job: CopyJob, nodes: list[HiTreeNode], ok: bool) -> None:
        """A write-through ended on every rank: its nodes are evictable again; a failed one (on any rank) leaves no
        host copy."""
        for x in nodes:
            self.dec_lock_ref(x)
            y: HiTreeNode | None = x
            while y is not None and y.backup is job:  # the node and the upper halves split off it since
                if not ok and y.host_pages is not None:
                    self.host_pool.free(y.host_pages)
                    y.host_pages = None
                y.backup, y = None, y.parent  # type: ignore[assignment]

    def _finish_load(self, op: LoadOp, ok: bool) -> None:
        self.stats.loaded(op.job)
        self.dec_lock_ref(op.nodes[-1])
        for x in op.nodes:
            x.loading = None
        if ok:
            return
        logger.warning("a host -> device load of %d tokens failed: they leave the cache and are recomputed",
                       sum(len(x.key) for x in op.nodes))
        self._uncount(op)
        top = op.nodes[0]
        if top.parent is not None and top.lock_ref == 0:  # no request holds the run: drop it with what hangs below
            self._delete_subtree(top)

    def _abandon_load(self, op: LoadOp) -> None:
        """Stop waiting for ``op``: its run is host-only again (its requests compute it, or an insert gives it
        pages); its device pages stay reserved until its copy can no longer write them."""
        self.dec_lock_ref(op.nodes[-1])
        slots = torch.cat([x.value for x in op.nodes])  # type: ignore[misc]
        for x in op.nodes:  # unlocked now: nothing but the load held the run
            x.value, x.loading, x.fence = None, None, None
            self.evictable_size_ -= len(x.key)
        self.waits.abandon(op.job, lambda: self.token_to_kv_pool_allocator.free(slots))  # once no copy writes them
        self._uncount(op)

    @staticmethod
    def _uncount(op: LoadOp) -> None:
        op.req.cached_tokens_host -= op.host_tokens
        op.req.cached_tokens_storage -= op.storage_tokens

    def _overtake_load(self, node: HiTreeNode) -> None:
        """An insert reaches ``node`` while a load brings it back: the inserted pages serve instead (no step waits
        for a copy)."""
        op = next(op for op in self.ongoing_loads if node in op.nodes)
        self.ongoing_loads.remove(op)
        self._abandon_load(op)

    # -- insertion -------------------------------------------------------------------------------------------------
    def insert(self, key: list[int], value: torch.Tensor) -> int:
        if self.disable:
            return 0
        n_aligned = self._aligned(len(key))
        key, value = key[:n_aligned], value[:n_aligned]
        node = self.root_node
        node.touch()
        matched = 0
        while key and (child := node.children.get(self._child_key(key))) is not None:
            if child.loading is not None:
                self._overtake_load(child)
            child.touch()
            n = self._key_match(child.key, key)
            if n < len(child.key):
                child = self._split_node(child, n)
            if child.on_device:
                matched += n
            else:  # host-only: our pages become its device copy
                child.value = value[:n].clone()
                self._fence(child)
                self.evictable_size_ += n
            node, key, value = child, key[n:], value[n:]
        if key:
            new = HiTreeNode()
            new.parent, new.key, new.value = node, list(key), value.clone()
            self._fence(new)
            if self.storage is not None:
                new.page_hashes = self.storage.page_keys(node, new.key)
            node.children[self._child_key(key)] = new
            self.evictable_size_ += len(key)
            if self.write_policy == "write_through":
                self.write_backup([new], lock=True)
        return matched

    def hicache_report(self) -> HiCacheLoad:
        report = self.stats.report(self.host_pool.used_pages, self.host_pool.num_pages, self.page_size)
        if (tier := self.storage) is not None:
            report.storage_read_bytes, report.storage_write_bytes, report.storage = (
                tier.read_bytes, tier.write_bytes, tier.identity)
            report.storage_dropped_pages, report.timeouts = tier.dropped_pages, report.timeouts + tier.timeouts
        return report

    def _fence(self, node: HiTreeNode) -> None:
        """``node``'s pages came from the batches launched so far: a copy of them waits for the last one."""
        node.fence = self.fence()
        if node.fence is not None:
            self.fenced.append(node)

    def _hit(self, node: HiTreeNode) -> None:
        node.hit_count += 1
        if self.write_policy == "write_through_selective" and node.hit_count >= 2 and node.host_pages is None:
            self.write_backup([node], lock=True)

    # -- tree plumbing ---------------------------------------------------------------------------------------------
    def _split_node(self, child: HiTreeNode, split_len: int) -> HiTreeNode:  # type: ignore[override]
        parent = child.parent
        assert parent is not None
        new = HiTreeNode()
        new.parent, new.key = parent, child.key[:split_len]
        new.lock_ref, new.last_access_time = child.lock_ref, child.last_access_time
        split_tiers(new, child, split_len, self.page_size)
        child.parent, child.key = new, child.key[split_len:]
        new.children[self._child_key(child.key)] = child
        parent.children[self._child_key(new.key)] = new
        for op in self.ongoing_loads:  # a load's path gains the upper half
            if child in op.nodes:
                op.nodes.insert(op.nodes.index(child), new)
        return new

    def all_values(self) -> torch.Tensor:
        values = [x.value for x in self._nodes() if x.value is not None]
        return torch.cat(values) if values else self._empty()
