"""``CopyEngine``: moves batches of KV pages between the device pool and the host pool on threads of its own (and
CUDA streams of its own), so no copy blocks the scheduler's step.

    write(device_pages, host_pages, fence)   device -> host (write-through, write-back, a decode node's offload)
    load(host_pages, device_pages, fence)    host -> device (a prefix coming back, a retracted request restored)

Each job copies every buffer of the device pool's slot space (the target's layers and a drafter's extra layers:
``host_pool.slot_space_groups``) with one gather and one scatter per layer group (``--hicache-io-backend kernel``: one
launch for every layer of a group, ``common.engine.kernels.kv_pages``; ``direct``: one torch index op per layer
buffer), through staging tensors the job owns. Writes and loads run on a thread (and stream) each, in submission
order per kind: a load that hangs holds up later loads only, never the writes an eviction waits for. The two never
touch one page at once: a load reads host pages whose write has ended and fills device pages no write reads
(``hiradix_cache``).

Cancelling (the invariant a waiter that gives up relies on): a job reads its source into its staging tensors (on
CUDA: into device tensors of its own), then ``claim``s its destination, then writes it. ``cancel`` and ``claim``
exclude each other: once ``cancel`` returned True the job never writes a byte of its destination pages, however
late it wakes up (it ends with ``CopyCancelled``), so they may be handed out again at once; once it returned False
the job is writing them and owns them until ``done``. A job hung anywhere before its claim (its fence, the host
read, the host -> device transfer) can be given up without keeping its destination.

The fence (the hazard: ``common.engine.scheduler.Scheduler.step_overlap``): under the overlap schedule a batch may
still be running when the scheduler hands its pages to a copy: a finished request's last page can still receive
the in-flight batch's KV write, and a page freed outside result processing (an eviction) may still be written by
it. So every job first waits for the batch launched last when it was submitted (its future; on CUDA the copy
stream then waits on the device's default stream, which the forward enqueued its kernels on). A job's pages are
owned by it until ``done`` (its destination pages: or a ``cancel`` that returned True): the cache neither frees nor
reuses them before (``hiradix_cache``, ``load_waits``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from common.engine.kernels.kv_pages import gather_pages, gather_pages_ref, scatter_pages, scatter_pages_ref
from common.engine.mem.hicache.host_pool import HostKVPool, Staging

logger = logging.getLogger(__name__)

Fence = Future[Any] | None  # the last launched batch's future when the job was submitted (None: nothing in flight)
JOB_TIMEOUT_S = 60.0  # a copy of host memory that takes longer is broken: the waiter fails instead of hanging
KINDS = ("write", "load")


class CopyCancelled(Exception):
    """A job's waiter gave it up before it started (``CopyJob.cancel``)."""


@dataclass(eq=False)
class CopyJob:
    kind: str  # "write" | "load"
    device_pages: torch.Tensor
    host_pages: torch.Tensor
    fence: Fence
    then: Callable[[Staging], None] | None = None  # write: runs on the copy thread with the staged pages
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    seconds: float = 0.0
    nbytes: int = 0
    cancelled: bool = False  # the waiter gave it up before its claim: it never writes its destination
    claimed: bool = False  # the copy thread writes (wrote) its destination
    _claim: threading.Lock = field(default_factory=threading.Lock)

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> bool:
        """Whether the job completed without error (raises TimeoutError past ``timeout``)."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"a KV {self.kind} of {len(self.host_pages)} pages took over {timeout:.0f} s")
        return self.error is None

    @property
    def ok(self) -> bool:
        return self.done.is_set() and self.error is None

    def cancel(self) -> bool:
        """Give the job up: True if it will never write its destination pages (not claimed yet; it ends without
        them), False if it is writing them (they are its until ``done``)."""
        with self._claim:
            self.cancelled = not self.claimed
            return self.cancelled

    def claim(self) -> None:
        """The copy thread, right before it writes the destination: raises ``CopyCancelled`` if given up."""
        with self._claim:
            if self.cancelled:
                raise CopyCancelled(f"a KV {self.kind} of {len(self.host_pages)} pages")
            self.claimed = True


class CopyEngine:
    def __init__(self, device_groups: Sequence[Sequence[torch.Tensor]], host_pool: HostKVPool, io_backend: str) -> None:
        if [(len(g), g[0].shape[1:], g[0].dtype) for g in device_groups] != [
                (h.num_buffers, h.page_shape[1:], h.dtype) for h in host_pool.groups]:
            raise ValueError("the host KV pool's layer groups are not the device buffers'")
        self.host = host_pool
        self.page_size = host_pool.page_size
        self.device = device_groups[0][0].device
        self.groups = [list(g) for g in device_groups]
        self.kernel = io_backend == "kernel"
        cuda = self.device.type == "cuda"
        self.streams = {kind: torch.cuda.Stream(self.device) if cuda else None for kind in KINDS}
        self._jobs: dict[str, queue.Queue[CopyJob | None]] = {kind: queue.Queue() for kind in KINDS}
        self._threads = [threading.Thread(target=self._run, args=(kind,), name=f"pdcluster-hicache-{kind}",
                                          daemon=True) for kind in KINDS]
        for t in self._threads:
            t.start()

    def write(self, device_pages: torch.Tensor, host_pages: torch.Tensor, fence: Fence,
              then: Callable[[Staging], None] | None = None) -> CopyJob:
        return self._submit(CopyJob("write", device_pages, host_pages, fence, then))

    def load(self, host_pages: torch.Tensor, device_pages: torch.Tensor, fence: Fence) -> CopyJob:
        return self._submit(CopyJob("load", device_pages, host_pages, fence))

    def close(self) -> None:
        for jobs in self._jobs.values():
            jobs.put(None)
        for t in self._threads:
            t.join(timeout=JOB_TIMEOUT_S)

    def _submit(self, job: CopyJob) -> CopyJob:
        if len(job.device_pages) != len(job.host_pages):
            raise ValueError(f"a copy of {len(job.device_pages)} device pages to {len(job.host_pages)} host pages")
        job.nbytes = len(job.host_pages) * self.host.bytes_per_page
        self._jobs[job.kind].put(job)
        return job

    # -- the copy thread -------------------------------------------------------------------------------------------
    def _run(self, kind: str) -> None:
        jobs = self._jobs[kind]
        while (job := jobs.get()) is not None:
            start = time.monotonic()
            try:
                if not job.cancelled and job.fence is not None:
                    job.fence.result()  # the forward of the batch launched last has been enqueued (or has run)
                if job.cancelled:
                    raise CopyCancelled(f"a KV {job.kind} of {len(job.host_pages)} pages")
                staged = self._copy(job)
                if job.then is not None and staged is not None:
                    job.then(staged)
            except CopyCancelled as e:
                job.error = e
            except BaseException as e:  # the waiter sees it (a failed load falls back to recompute)
                logger.exception("KV %s of %d pages failed", job.kind, len(job.host_pages))
                job.error = e
            job.seconds = time.monotonic() - start
            job.done.set()

    def _copy(self, job: CopyJob) -> Staging | None:
        stream = self.streams[job.kind]
        if stream is None:
            return self._copy_pages(job)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.default_stream(self.device))
            staged = self._copy_pages(job)
            stream.synchronize()
            return staged

    def _copy_pages(self, job: CopyJob) -> Staging | None:
        n, host = len(job.host_pages), self.host
        device_pages = job.device_pages.to(self.device, non_blocking=True)
        stream = self.streams[job.kind]
        pinned = stream is not None
        staging = host.empty_staging(n, pin=pinned)
        if job.kind == "write":
            for bufs, staged in zip(self.groups, staging, strict=True):
                if stream is None:
                    self._gather(bufs, device_pages, staged)
                else:
                    on_device = torch.empty(staged.shape, dtype=staged.dtype, device=self.device)
                    self._gather(bufs, device_pages, on_device)
                    staged.copy_(on_device, non_blocking=True)
            if stream is not None:
                stream.synchronize()
            job.claim()
            host.scatter(job.host_pages, staging)
            return staging
        host.gather(job.host_pages, staging)
        moved = [staged.to(self.device, non_blocking=True) for staged in staging]
        if stream is not None:
            stream.synchronize()  # the host -> device transfer has ended: what is left writes device pages only
        job.claim()
        for bufs, staged in zip(self.groups, moved, strict=True):
            self._scatter(bufs, device_pages, staged)
        return None

    def _gather(self, buffers: list[torch.Tensor], pages: torch.Tensor, out: torch.Tensor) -> None:
        (gather_pages if self.kernel else gather_pages_ref)(buffers, pages, self.page_size, out)

    def _scatter(self, buffers: list[torch.Tensor], pages: torch.Tensor, src: torch.Tensor) -> None:
        (scatter_pages if self.kernel else scatter_pages_ref)(buffers, pages, self.page_size, src)
