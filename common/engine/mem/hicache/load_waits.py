"""``LoadWaits``: how long a request waits in the queue for a host -> device load (``--hicache-load-timeout``), the
loads given up on, and the write-throughs whose end unlocks their nodes, agreed over the TP group.

A request whose prefix comes back from the host waits in the queue; the step never blocks on the copy. Each step
``poll`` gives every load the group's verdict, in one collective::

    OK        every rank's copy ended without error
    FAILED    every rank's copy ended, one with an error (its tokens are recomputed)
    EXPIRED   a rank's copy is still running past the load's deadline: its requests stop waiting and compute what
              it would have brought (same outputs)
    WAIT      neither

and every write waited for (in submission order) OK, FAILED or WAIT alike.

A load given up on (``abandon``: expired, overtaken, its request gone) is cancelled (``CopyJob.cancel``). Its
device pages are released at the first ``poll`` at which, on every rank, the copy either can no longer write them
(cancelled before its claim: a copy that wakes up later ends without touching them) or has ended: a late copy
never writes into pages handed out since. While a load given up on has not ended on some rank the load thread is
behind it (``stuck``): the caches start no new load then, which bounds what a hung copy holds to the loads in
flight when it hung (and, once cancelled, to none of its device pages).

A write the step itself waits for (an eviction's, a decode node's retraction offload: ``settle_write``) is agreed
in one collective at that point: its host copy is kept only if every rank's write ended without error within
``write_timeout_s``; else every rank gives it up like a load (its host pages released once no rank's copy writes
them) and drops the copy, so no rank hits a host copy another lacks. While a write given up on has not ended the
write thread is behind it (``writes_stuck``): the caches start no write they would wait for then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.config import TP_MIN_TIMEOUT_S
from common.engine.distributed import TPGroup
from common.engine.mem.hicache.copy_engine import CopyJob

logger = logging.getLogger(__name__)

OK, FAILED, EXPIRED, WAIT = "ok", "failed", "expired", "wait"
WRITE_WAIT_S = TP_MIN_TIMEOUT_S / 2  # a rank whose write hangs joins the agreement before its peers' collective ends


@dataclass(eq=False)
class Abandoned:
    job: CopyJob
    release: Callable[[], None] | None  # frees the pages the copy writes into; None once run
    fenced_off: bool  # this rank's copy was cancelled before its claim: it never writes them


class LoadWaits:
    def __init__(self, tp: TPGroup, timeout_s: float) -> None:
        self.tp = tp
        self.timeout_s = timeout_s
        self.abandoned: list[Abandoned] = []  # in the order given up
        self.write_timeout_s = WRITE_WAIT_S

    @property
    def stuck(self) -> bool:
        """A load given up on has not ended (on some rank): a new load would only queue behind it."""
        return any(a.job.kind == "load" for a in self.abandoned)

    @property
    def writes_stuck(self) -> bool:
        """A write given up on has not ended (on some rank): a new write would only queue behind it."""
        return any(a.job.kind == "write" for a in self.abandoned)

    @property
    def settling(self) -> bool:
        """A copy given up on has not ended (on some rank): ``poll`` releases its pages and forgets it."""
        return bool(self.abandoned)

    def deadline(self) -> float:
        """The deadline of a load submitted now."""
        return time.monotonic() + self.timeout_s

    def abandon(self, job: CopyJob, release: Callable[[], None]) -> None:
        """Stop waiting for ``job``; ``release`` frees the pages it writes into once no rank's copy can."""
        self.abandoned.append(Abandoned(job, release, job.cancel()))

    def settle_write(self, job: CopyJob, release: Callable[[], None]) -> bool:
        """Whether ``job``'s host copy is kept: its write ended without error on every rank (one collective). If
        not, it is given up on every rank: ``release`` frees its host pages once no rank's copy writes them."""
        try:
            ok = job.wait(self.write_timeout_s)
        except TimeoutError:
            logger.warning("a device -> host write of %d pages ran past %.1f s: its host copy is dropped",
                           len(job.host_pages), self.write_timeout_s)
            ok = False
        if self.tp.tp_size > 1:
            ok = bool(self.tp.all_reduce_min(torch.tensor([int(ok)], dtype=torch.int64)).item())
        if not ok:
            self.abandon(job, release)
        return ok

    def poll(self, waits: Sequence[tuple[CopyJob, float]], writes: Sequence[CopyJob] = ()
             ) -> tuple[list[str], list[str]]:
        """The verdict on each ``(job, deadline)`` waited for and on each write; the pages of the loads given up on
        that no copy writes any more are released."""
        if not waits and not writes and not self.abandoned:
            return [], []
        now = time.monotonic()
        states = [self._state(job) for job, _ in waits]
        late = [-int(now > deadline) for _, deadline in waits]  # MIN of the negation: whether any rank is late
        written = [self._state(job) for job in writes]
        safe = [int(a.fenced_off or a.job.done.is_set()) for a in self.abandoned]
        ended = [int(a.job.done.is_set()) for a in self.abandoned]
        flags = states + late + written + safe + ended
        if self.tp.tp_size > 1:
            flags = self.tp.all_reduce_min(torch.tensor(flags, dtype=torch.int64)).tolist()
        n, w, k = len(waits), len(writes), len(self.abandoned)
        rest = flags[2 * n + w:]
        still = []
        for entry, off, end in zip(self.abandoned, rest[:k], rest[k:], strict=True):
            if off and entry.release is not None:
                entry.release()
                entry.release = None
            if not end:
                still.append(entry)
        self.abandoned = still
        verdicts = [OK if s == 2 else FAILED if s == 1 else EXPIRED if x else WAIT
                    for s, x in zip(flags[:n], flags[n: 2 * n], strict=True)]
        return verdicts, [OK if s == 2 else FAILED if s == 1 else WAIT for s in flags[2 * n: 2 * n + w]]

    @staticmethod
    def _state(job: CopyJob) -> int:
        return (2 if job.error is None else 1) if job.done.is_set() else 0
