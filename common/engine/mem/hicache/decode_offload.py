"""``HiHeldPrefixCache``: a decode node's prefix cache (``HeldPrefixCache``) with a host tier for retracted requests.

Without it a retracted decode request is recomputed locally: its prompt and outputs are prefilled again on this
node. With it, the request's KV is copied to the host pool when it is retracted and copied back when it resumes::

    release_retracted   its first n positions' pages -> host (n = what it resumes from: every committed position
                        but the newest token's, which the resuming extend recomputes for its next logits); the
                        copy waits for the batch in flight (it may still write the last page), then the pages go;
                        a copy that failed or ran late on any rank keeps no record on any (``LoadWaits.settle_write``):
                        the request is recomputed on every rank
    init_load_back      at its turn in the waiting queue: fresh device pages, the host copy loaded into them (the
                        request waits, until --hicache-load-timeout); once loaded, its prefix is those pages and it
                        extends one token
    check_hicache_events  finished loads become restorable; a restored request that was admitted owns its pages
                        (the record goes); one that left first (an abort) has its pages freed; a load past its
                        deadline, or whose request left, is given up (``LoadWaits``: its pages stay reserved until
                        its copy can no longer write them) and the request is recomputed

The host pool keeps the records of the most recent retractions: a retraction that finds it full drops the oldest
records not being restored (those requests are recomputed). Outputs are those of an uninterrupted request: the
restored KV is the KV it had, and its next token comes from the same positions.
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
from common.engine.mem.held_prefix_cache import HeldPrefixCache
from common.engine.mem.hicache.copy_engine import CopyEngine, CopyJob, Fence
from common.engine.mem.hicache.host_pool import HostKVPool
from common.engine.mem.hicache.load_waits import EXPIRED, OK, WAIT, LoadWaits
from common.engine.mem.hicache.stats import HiCacheStats
from common.engine.mem.hicache.tree import device_pages
from common.engine.mem.radix_cache import _req_slot
from common.engine.mem.req_to_token_pool import ReqToTokenPool

if TYPE_CHECKING:
    from common.engine.req import Req

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Offload:
    req: Req
    host_pages: torch.Tensor | None
    num_tokens: int  # positions [0, num_tokens) are kept
    device: torch.Tensor | None = None  # slots of the restore (the request's prefix once loaded)
    job: CopyJob | None = None
    deadline: float = 0.0  # of the restore's wait
    restored: bool = False


class HiHeldPrefixCache(HeldPrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, page_size: int, *,
                 host_pool: HostKVPool, copier: CopyEngine, fence: Callable[[], Fence], tp: TPGroup,
                 load_timeout: float) -> None:
        self.host_pool = host_pool
        self.copier = copier
        self.fence = fence
        self.tp = tp
        self.waits = LoadWaits(tp, load_timeout)
        self.stats = HiCacheStats()
        self.offloads: dict[int, Offload] = {}  # id(req) -> its record, oldest retraction first
        self.restoring: list[Offload] = []  # loads in flight, in submission order
        super().__init__(req_to_token_pool, allocator, page_size)

    def close(self) -> None:
        self.copier.close()

    def hicache_report(self) -> HiCacheLoad:
        return self.stats.report(self.host_pool.used_pages, self.host_pool.num_pages, self.page_size)

    # -- retraction ------------------------------------------------------------------------------------------------
    def release_retracted(self, req: Req) -> None:
        keep = min(req.kv_committed_len, len(req.all_ids()) - 1)
        num = -(-keep // self.page_size)
        host = self._alloc_host(num) if keep > 0 and not self.waits.writes_stuck else None
        if host is not None:
            row = self.req_to_token_pool.req_to_token[_req_slot(req)]
            job = self.copier.write(device_pages(row[: num * self.page_size], self.page_size), host, self.fence())
            if self.waits.settle_write(job, lambda: self.host_pool.free(host)):  # every rank's copy: else recomputed
                self.offloads[id(req)] = Offload(req, host, keep)
            self.stats.track_write(job)
        self.cache_finished_req(req)

    def _alloc_host(self, num_pages: int) -> torch.Tensor | None:
        pages = self.host_pool.alloc(num_pages)
        for key, rec in list(self.offloads.items()):  # the oldest records first
            if pages is not None:
                break
            if rec.job is None and rec.host_pages is not None:
                self.host_pool.free(rec.host_pages)
                del self.offloads[key]
                pages = self.host_pool.alloc(num_pages)
        return pages

    # -- resuming --------------------------------------------------------------------------------------------------
    def init_load_back(self, req: Req, mem_quota: int) -> bool:
        rec = self.offloads.get(id(req))
        if rec is None:
            return False
        if rec.restored:
            assert rec.device is not None
            req.prefix_indices, req.last_node = rec.device, None  # its own pages, not the held prompt's
            req.extend_input_len = len(req.fill_ids) - len(rec.device)
            req.cached_tokens_host = len(rec.device)
            return False
        if rec.job is not None:
            return True
        if self.waits.stuck:  # the load thread is behind a restore given up on: recompute this one
            self._drop(id(req), rec)
            return False
        if mem_quota <= 0:
            return False
        slots = self.token_to_kv_pool_allocator.alloc(rec.num_tokens)
        if slots is None:
            return False
        assert rec.host_pages is not None
        rec.device = slots
        rec.job = self.copier.load(rec.host_pages, device_pages(slots, self.page_size), self.fence())
        rec.deadline = self.waits.deadline()
        self.restoring.append(rec)
        return True

    def check_hicache_events(self) -> None:
        if self.restoring or self.waits.settling:
            recs = self.restoring
            verdicts, _ = self.waits.poll([(r.job, r.deadline) for r in recs])  # type: ignore[misc]
            self.restoring = [r for r, verdict in zip(recs, verdicts, strict=True) if verdict == WAIT]
            for rec, verdict in zip(recs, verdicts, strict=True):
                if verdict == EXPIRED:
                    logger.warning("rid=%s: restoring its KV from the host ran past --hicache-load-timeout (%.1f s); "
                                   "it is recomputed", rec.req.rid, self.waits.timeout_s)
                    self.stats.timeouts += 1
                    self._abandon(rec)
                elif verdict != WAIT:
                    self._finish_restore(rec, verdict == OK)
        for key, rec in list(self.offloads.items()):
            if rec.restored and not rec.req.is_retracted:
                del self.offloads[key]  # admitted: the pages are the request's now
            elif rec.req.finished():  # it left while waiting (an abort): its pages go, once no copy uses them
                if rec in self.restoring:
                    self.restoring.remove(rec)
                    self._abandon(rec)
                else:
                    self._drop(key, rec)

    def _abandon(self, rec: Offload) -> None:
        """Stop waiting for ``rec``'s restore: the record goes; its pages once the copy has ended."""
        assert rec.job is not None
        device, host = rec.device, rec.host_pages

        def release() -> None:
            self.token_to_kv_pool_allocator.free(device)  # type: ignore[arg-type]
            self.host_pool.free(host)  # type: ignore[arg-type]

        self.waits.abandon(rec.job, release)
        del self.offloads[id(rec.req)]

    def _finish_restore(self, rec: Offload, ok: bool) -> None:
        assert rec.job is not None and rec.host_pages is not None
        self.stats.loaded(rec.job)
        self.host_pool.free(rec.host_pages)
        rec.host_pages = None
        if ok:
            rec.restored = True
            return
        logger.warning("rid=%s: restoring its KV from the host failed; it is recomputed", rec.req.rid)
        self._drop(id(rec.req), rec)

    def _drop(self, key: int, rec: Offload) -> None:
        if rec.device is not None:
            self.token_to_kv_pool_allocator.free(rec.device)
        if rec.host_pages is not None:
            self.host_pool.free(rec.host_pages)
        del self.offloads[key]
