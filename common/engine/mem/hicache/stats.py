"""What the hierarchical cache counts for ``/metrics``: bytes and seconds of its copies, its evictions, the loads
it gave up on, since the rank started (the load report carries them, with the storage tier's traffic; the front
turns them into counters)."""

from __future__ import annotations

from common.engine.io_struct import HiCacheLoad
from common.engine.mem.hicache.copy_engine import CopyJob


class HiCacheStats:
    def __init__(self) -> None:
        self.load_bytes = 0
        self.load_seconds = 0.0
        self.write_bytes = 0
        self.write_seconds = 0.0
        self.host_evicted_pages = 0
        self.timeouts = 0
        self.hit_tokens = {"device": 0, "host": 0, "storage": 0}
        self._writes: list[CopyJob] = []  # submitted, not counted yet

    def hit(self, cached: int, host: int, storage: int) -> None:
        """A request starts its prefill with ``cached`` prompt tokens cached, of which ``host`` were loaded back from
        the host tier and ``storage`` read from the store."""
        self.hit_tokens["device"] += cached - host - storage
        self.hit_tokens["host"] += host
        self.hit_tokens["storage"] += storage

    def loaded(self, job: CopyJob) -> None:
        if job.ok:
            self.load_bytes += job.nbytes
            self.load_seconds += job.seconds

    def track_write(self, job: CopyJob) -> None:
        self._writes.append(job)
        if len(self._writes) > 64:
            self._settle()

    def _settle(self) -> None:
        pending = []
        for job in self._writes:
            if not job.done.is_set():
                pending.append(job)
            elif job.ok:
                self.write_bytes += job.nbytes
                self.write_seconds += job.seconds
        self._writes = pending

    def report(self, host_pages_used: int, host_pages_total: int, page_size: int) -> HiCacheLoad:
        self._settle()
        return HiCacheLoad(
            host_tokens_used=host_pages_used * page_size,
            host_tokens_total=host_pages_total * page_size,
            load_bytes=self.load_bytes,
            load_seconds=self.load_seconds,
            write_bytes=self.write_bytes,
            write_seconds=self.write_seconds,
            host_evicted_tokens=self.host_evicted_pages * page_size,
            timeouts=self.timeouts,
            hit_tokens=dict(self.hit_tokens),
        )
