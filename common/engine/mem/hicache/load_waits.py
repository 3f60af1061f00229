"""``LoadWaits``: how long a request waits in the queue for a host -> device load (``--hicache-load-timeout``), and
the loads given up on, agreed over the TP group.

A request whose prefix comes back from the host waits in the queue; the step never blocks on the copy. Each step
``poll`` gives every load the group's verdict, in one collective::

    OK        every rank's copy ended without error
    FAILED    every rank's copy ended, one with an error (its tokens are recomputed)
    EXPIRED   a rank's copy is still running past the load's deadline: its requests stop waiting and compute what
              it would have brought (same outputs)
    WAIT      neither

A load given up on (``abandon``: expired, overtaken, its request gone) is cancelled if its copy has not started,
and the pages it holds stay reserved until its copy has ended on every rank: a late copy writes only into them,
never into pages handed out since. ``poll`` then runs its ``release``. While one is outstanding the load thread is
behind it (``stuck``): the caches start no new load then, which bounds what a hung copy holds to the loads in
flight when it hung.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from common.engine.distributed import TPGroup
from common.engine.mem.hicache.copy_engine import CopyJob

OK, FAILED, EXPIRED, WAIT = "ok", "failed", "expired", "wait"


class LoadWaits:
    def __init__(self, tp: TPGroup, timeout_s: float) -> None:
        self.tp = tp
        self.timeout_s = timeout_s
        self.abandoned: list[tuple[CopyJob, Callable[[], None]]] = []  # in the order given up

    @property
    def stuck(self) -> bool:
        """A load given up on has not ended (on some rank): a new load would only queue behind it."""
        return bool(self.abandoned)

    def deadline(self) -> float:
        """The deadline of a load submitted now."""
        return time.monotonic() + self.timeout_s

    def abandon(self, job: CopyJob, release: Callable[[], None]) -> None:
        """Stop waiting for ``job``; ``release`` frees the pages it holds once it has ended on every rank."""
        job.cancel()
        self.abandoned.append((job, release))

    def poll(self, waits: Sequence[tuple[CopyJob, float]]) -> list[str]:
        """The verdict on each ``(job, deadline)`` waited for; the abandoned loads that ended are released."""
        if not waits and not self.abandoned:
            return []
        now = time.monotonic()
        states = [(2 if job.error is None else 1) if job.done.is_set() else 0 for job, _ in waits]
        late = [-int(now > deadline) for _, deadline in waits]  # MIN of the negation: whether any rank is late
        ended = [int(job.done.is_set()) for job, _ in self.abandoned]
        flags = states + late + ended
        if self.tp.tp_size > 1:
            flags = self.tp.all_reduce_min(torch.tensor(flags, dtype=torch.int64)).tolist()
        n = len(waits)
        still = []
        for entry, end in zip(self.abandoned, flags[2 * n:], strict=True):
            if end:
                entry[1]()
            else:
                still.append(entry)
        self.abandoned = still
        return [OK if s == 2 else FAILED if s == 1 else EXPIRED if x else WAIT
                for s, x in zip(flags[:n], flags[n: 2 * n], strict=True)]
