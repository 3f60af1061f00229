"""The process's UCX runtime: its context and the asyncio loop thread that progresses it (``UcxRuntime``, shared by the
process's ``ucx`` backends and stopped with the last of them), in ucxx's "blocking" progress mode as it was meant to
work (``RearmingBlockingMode``): the UCX worker's event fd wakes the loop, and the worker is armed again once
progressed.

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
import gc
import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import ucxx
from ucxx._lib_async import application_context
from ucxx._lib_async.continuous_ucx_progress import BlockingMode
from ucxx.exceptions import UCXError

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0  # loop-thread housekeeping calls (listen, abort, shutdown, a cancelled flush)


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


class UcxRuntime:
    """The process's UCX context and the event loop thread it progresses on (refcounted by backends)."""

    _lock = threading.Lock()
    _users = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, tls: str, progress_mode: str, device: torch.device) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None:
                install()  # ucxx's own "blocking" mode spins after the first event
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="kv-ucx-loop", daemon=True)
                thread.start()

                async def init() -> None:
                    if device.type == "cuda":  # UCX's CUDA transports use the loop thread's current context
                        torch.cuda.set_device(device)
                    # env_takes_precedence: a user's UCX_* variables override these defaults. ucxx itself sets
                    # UCX_MEMTYPE_CACHE, which libucx 1.21 no longer knows and would warn about at every start.
                    ucxx.init(options={"TLS": tls, "WARN_UNUSED_ENV_VARS": "n"}, env_takes_precedence=True,
                              progress_mode=progress_mode)

                try:
                    asyncio.run_coroutine_threadsafe(init(), loop).result(CALL_TIMEOUT_S)
                except BaseException:
                    loop.call_soon_threadsafe(loop.stop)
                    thread.join(CALL_TIMEOUT_S)
                    loop.close()
                    raise
                cls._loop, cls._thread = loop, thread
            cls._users += 1
            return cls._loop

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._users -= 1
            if cls._users or cls._loop is None or cls._thread is None:
                return
            loop, thread = cls._loop, cls._thread
            cls._loop = cls._thread = None

            async def reset() -> None:
                gc.collect()  # endpoints/listeners must be gone before reset()
                ucxx.reset()

            try:
                asyncio.run_coroutine_threadsafe(reset(), loop).result(CALL_TIMEOUT_S)
            except (UCXError, FutureTimeout) as exc:
                log.warning("kv ucx: UCX reset incomplete: %s", exc)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(CALL_TIMEOUT_S)
            loop.close()
