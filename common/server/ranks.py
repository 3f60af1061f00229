"""``RankClient``: the front process's handle on its scheduler rank processes.

Starts one process per DP rank, sends each its inputs, and routes every output back to the waiter registered for
its request id. A rank that dies fails its in-flight requests with UNAVAILABLE; no wait is unbounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from common.config import ServerArgs
from common.io_struct import (
    LoadOut,
    LoadReq,
    QueueLoad,
    RankHeartbeat,
    RankReady,
    SchedulerInput,
    ShutdownReq,
    TokenOut,
)
from common.server.ipc import IpcAddrs, decode_outputs, encode
from common.server.scheduler_process import run_scheduler_process

logger = logging.getLogger(__name__)


class RankError(Exception):
    pass


class RankClient:
    def __init__(self, args: ServerArgs, model_path: str, scheduler_ref: str) -> None:
        self.args = args
        self.model_path = model_path
        self.scheduler_ref = scheduler_ref
        self.addrs = IpcAddrs.new()
        self.ctx = zmq.asyncio.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.addrs.out)
        self.pushes: list[zmq.asyncio.Socket] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.waiters: dict[str, Callable[[Any], None]] = {}
        self.rid_rank: dict[str, int] = {}
        self.inflight = [0] * args.dp_size
        self.max_total_tokens = 0
        # time.monotonic() of each rank's last RankHeartbeat (or RankReady); read by the liveness endpoint's thread.
        self.last_heartbeat = [0.0] * args.dp_size
        self._ready: dict[int, RankReady] = {}
        self._ready_event = asyncio.Event()
        self._load_waiters: dict[int, list[asyncio.Future[QueueLoad]]] = {r: [] for r in range(args.dp_size)}
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = False

    async def start(self, timeout: float = 300.0) -> None:
        spawn = multiprocessing.get_context("spawn")
        for rank in range(self.args.dp_size):
            proc = spawn.Process(
                target=run_scheduler_process,
                args=(self.args, self.model_path, rank, self.addrs, self.scheduler_ref, os.getpid()),
                name=f"pdcluster-scheduler-{rank}",
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self.addrs.rank_in(rank))
            self.pushes.append(push)
        self._tasks = [asyncio.create_task(self._dispatch()), asyncio.create_task(self._watch())]
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout)
        except TimeoutError:
            raise RankError(f"scheduler ranks not ready within {timeout:.0f} s") from None
        errors = [r.error for r in self._ready.values() if r.error]
        if errors:
            raise RankError("scheduler rank failed to start: " + "; ".join(errors))
        self.max_total_tokens = min(r.max_total_tokens for r in self._ready.values())

    async def _dispatch(self) -> None:
        while True:
            frame = await self.pull.recv()
            for msg in decode_outputs(frame):
                if isinstance(msg, RankHeartbeat):
                    self.last_heartbeat[msg.dp_rank] = time.monotonic()
                elif isinstance(msg, RankReady):
                    self.last_heartbeat[msg.dp_rank] = time.monotonic()
                    self._ready[msg.dp_rank] = msg
                    if len(self._ready) == self.args.dp_size or msg.error:
                        self._ready_event.set()
                elif isinstance(msg, LoadOut):
                    for fut in self._load_waiters[msg.load.dp_rank]:
                        if not fut.done():
                            fut.set_result(msg.load)
                    self._load_waiters[msg.load.dp_rank].clear()
                else:
                    deliver = self.waiters.get(msg.rid)
                    if deliver is not None:
                        deliver(msg)

    async def _watch(self) -> None:
        """Fail the requests of a rank whose process died."""
        while True:
            await asyncio.sleep(0.5)
            for rank, proc in enumerate(self.procs):
                if proc.exitcode is not None and not self.closed:
                    self._fail_rank(rank, f"scheduler rank {rank} exited with code {proc.exitcode}")
                    if not self._ready_event.is_set():
                        self._ready[rank] = RankReady(dp_rank=rank, error=f"exited with code {proc.exitcode}")
                        self._ready_event.set()

    def _fail_rank(self, rank: int, message: str) -> None:
        for rid, r in list(self.rid_rank.items()):
            if r == rank and rid in self.waiters:
                self.waiters[rid](TokenOut(rid=rid, token_ids=[], finish_reason="abort", error=message,
                                           error_code="UNAVAILABLE"))

    def alive(self) -> bool:
        return not self.closed and all(p.exitcode is None for p in self.procs)

    def stalled_ranks(self, timeout: float) -> dict[int, float]:
        """Ranks whose last heartbeat is older than ``timeout`` seconds -> its age (ranks not yet ready: none)."""
        now = time.monotonic()
        return {r: now - t for r, t in enumerate(self.last_heartbeat) if t and now - t > timeout}

    # -- requests --------------------------------------------------------------------------------------------------
    def register(self, rid: str, rank: int, deliver: Callable[[Any], None]) -> None:
        self.waiters[rid] = deliver
        self.rid_rank[rid] = rank
        self.inflight[rank] += 1

    def unregister(self, rid: str) -> None:
        self.waiters.pop(rid, None)
        rank = self.rid_rank.pop(rid, None)
        if rank is not None:
            self.inflight[rank] -= 1

    def send(self, rank: int, msg: SchedulerInput) -> None:
        self.pushes[rank].send(encode(msg))

    def least_loaded_rank(self) -> int:
        return min(range(self.args.dp_size), key=lambda r: self.inflight[r])

    async def get_load(self, timeout: float = 5.0) -> list[QueueLoad]:
        """Every rank's load report; TimeoutError if one does not answer in time (its waiter is dropped)."""
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[QueueLoad]] = []
        for rank in range(self.args.dp_size):
            fut: asyncio.Future[QueueLoad] = loop.create_future()
            self._load_waiters[rank].append(fut)
            futs.append(fut)
            self.send(rank, LoadReq())
        _, pending = await asyncio.wait(futs, timeout=timeout)
        if pending:
            for rank, fut in enumerate(futs):
                if fut in pending:
                    fut.cancel()
                    with contextlib.suppress(ValueError):
                        self._load_waiters[rank].remove(fut)
            raise TimeoutError(f"{len(pending)} scheduler rank(s) did not report their load within {timeout} s")
        return [f.result() for f in futs]

    async def close(self, timeout: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        for rank, push in enumerate(self.pushes):
            if self.procs[rank].exitcode is None:
                with contextlib.suppress(zmq.ZMQError):
                    push.send(encode(ShutdownReq()), zmq.NOBLOCK)
        loop = asyncio.get_running_loop()
        for proc in self.procs:
            await loop.run_in_executor(None, proc.join, timeout)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
        for task in self._tasks:
            task.cancel()
        for push in self.pushes:
            push.close(0)
        self.pull.close(0)
        self.ctx.term()
        self.addrs.cleanup(self.args.dp_size)
