"""ucxx's "blocking" progress mode, as it was meant to work: the UCX worker's event fd wakes the loop, and the worker
is armed again once progressed.

ucxx 0.52's ``BlockingMode`` arms the worker once: its ``_arm_worker`` task ends after the first successful arm and
its fd callback never starts another, although the timeout task's comment says it does. After the first UCX event
the fd stays readable for good, so the loop thread calls the callback on every iteration: it spins on a core and
takes the GIL from the rank's scheduler thread (P/D over ``ucx`` served a fraction of ``tcp``'s tokens:
benchmarks/pages/soak.md).

``install`` puts ``RearmingBlockingMode`` in its place (ucx-py's behaviour: every fd event progresses the worker
and, unless an arm task is already running, starts one), before ucxx starts progress on a loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ucxx._lib_async import application_context
from ucxx._lib_async.continuous_ucx_progress import BlockingMode


class RearmingBlockingMode(BlockingMode):
    """``BlockingMode`` whose every worker event ends with the worker armed again (or an arm task on its way)."""

    def _fd_reader_callback(self) -> None:
        self.worker.progress()
        task: asyncio.Task[Any] | None = self.arm_task
        if task is None or task.done():
            self.arm_task = self.event_loop.create_task(self._arm_worker())

    async def _progress_with_timeout(self) -> None:
        """The safety net: a worker not progressed for ``progress_timeout`` is progressed and armed again (ucxx's
        cancels the arm task and leaves the worker unarmed)."""
        while (worker := self.worker) is not None:
            if time.monotonic() > self.last_progress_time + self._progress_timeout:
                self.last_progress_time = time.monotonic()
                worker.progress()
                task: asyncio.Task[Any] | None = self.arm_task
                if task is None or task.done():
                    self.arm_task = self.event_loop.create_task(self._arm_worker())
            await asyncio.sleep(self._progress_timeout)


def install() -> None:
    """Make ucxx's "blocking" progress mode rearm (idempotent; effective for progress started afterwards)."""
    application_context.BlockingMode = RearmingBlockingMode  # type: ignore[misc]
