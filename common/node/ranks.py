"""``RankClient``: the front process's handle on its scheduler rank processes.

Starts one process per (DP rank, TP rank) of this host, sends each DP replica's inputs to its TP rank 0, and routes
every output back to the waiter registered for its request id. With ``--tp-size`` > 1 it also serves the TP groups'
rendezvous store (``--dist-init-addr``, a free local port when unset). Any rank of a DP replica that dies fails the
replica's in-flight requests with UNAVAILABLE naming the rank; no wait is unbounded.
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
from common.engine.io_struct import (
    LoadOut,
    LoadReq,
    QueueLoad,
    RankHeartbeat,
    RankReady,
    SchedulerInput,
    ShutdownReq,
    TokenOut,
)
from common.errors import ErrorCode
from common.node.ipc import IpcAddrs, decode_outputs, encode

logger = logging.getLogger(__name__)


class RankError(Exception):
    pass


def run_rank(*args: Any) -> None:
    """A spawned rank's entry point. NOTE: the front pickles a reference to this function, not to the scheduler
    process module, so that the front itself never imports torch (the rank imports it here)."""
    from common.node.scheduler_process import run_scheduler_process

    run_scheduler_process(*args)


class RankClient:
    def __init__(self, args: ServerArgs, model_path: str) -> None:
        self.args = args
        self.model_path = model_path
        self.addrs = IpcAddrs.new()
        self.ctx = zmq.asyncio.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.addrs.out)
        self.pushes: list[zmq.asyncio.Socket] = []  # one per DP replica, to its TP rank 0 (on node 0 only)
        self.ranks = [(d, t) for d in range(args.dp_size) for t in args.tp_ranks_here]  # this host's processes
        self.procs: list[multiprocessing.process.BaseProcess] = []  # parallel to self.ranks
        self.waiters: dict[str, Callable[[Any], None]] = {}
        self.rid_rank: dict[str, int] = {}
        self.inflight = [0] * args.dp_size
        self.max_total_tokens = 0
        # time.monotonic() of each rank's last RankHeartbeat (or RankReady), parallel to self.ranks; read by the
        # liveness endpoint's thread.
        self.last_heartbeat = [0.0] * len(self.ranks)
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self._store: Any = None  # the TP rendezvous store, alive while the ranks run
        self._failed: set[int] = set()  # DP replicas whose requests were failed because a rank died
        self._ready: dict[tuple[int, int], RankReady] = {}
        self._ready_event = asyncio.Event()
        self._load_waiters: dict[int, list[asyncio.Future[QueueLoad]]] = {r: [] for r in range(args.dp_size)}
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = False

    @property
    def is_leader_host(self) -> bool:
        """This host runs every DP replica's TP rank 0 (the node the router sees)."""
        return self.args.node_rank == 0

    def _start_store(self) -> None:
        args = self.args
        if args.tp_size == 1 or not self.is_leader_host:
            return
        from common.engine.distributed import host_store  # torch.distributed: only a TP front needs it
        if args.dist_init_addr is None:  # single host: a free local port, told to the ranks through their args
            self._store = host_store("127.0.0.1:0", args.tp_timeout_s)
            self.args = args.replace(dist_init_addr=f"127.0.0.1:{self._store.port}")
        else:
            self._store = host_store(args.dist_init_addr, args.tp_timeout_s)

    def spawn(self) -> None:
        """Start the rank processes (once). Separate from ``start`` so the front can load its own state while the
        ranks import torch and load the model: on an idle core that overlaps seconds of start-up."""
        if self.procs:
            return
        self._start_store()
        spawn = multiprocessing.get_context("spawn")
        for dp_rank, tp_rank in self.ranks:
            proc = spawn.Process(
                target=run_rank,
                args=(self.args, self.model_path, dp_rank, self.addrs, os.getpid(), tp_rank),
                name=f"pdcluster-scheduler-dp{dp_rank}-tp{tp_rank}",
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)

    def kill(self) -> None:
        """Kill spawned rank processes at once (the front failed before ``start``)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()

    async def start(self, timeout: float = 300.0) -> None:
        self.spawn()
        if self.is_leader_host:
            for dp_rank in range(self.args.dp_size):
                push = self.ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.connect(self.addrs.rank_in(dp_rank))
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

    @staticmethod
    def describe(rank: tuple[int, int]) -> str:
        return f"dp={rank[0]} tp={rank[1]}"

    async def _dispatch(self) -> None:
        while True:
            frame = await self.pull.recv()
            for msg in decode_outputs(frame):
                if isinstance(msg, RankHeartbeat):
                    self.last_heartbeat[self._index[msg.dp_rank, msg.tp_rank]] = time.monotonic()
                elif isinstance(msg, RankReady):
                    self.last_heartbeat[self._index[msg.dp_rank, msg.tp_rank]] = time.monotonic()
                    self._ready[msg.dp_rank, msg.tp_rank] = msg
                    if len(self._ready) == len(self.ranks) or msg.error:
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
        """Fail the requests of a DP replica one of whose rank processes died (its TP peers fail with it)."""
        while True:
            await asyncio.sleep(0.5)
            if self.closed:
                continue
            dead = [(rank, proc.exitcode) for rank, proc in zip(self.ranks, self.procs, strict=True)
                    if proc.exitcode is not None]
            for dp_rank in sorted({rank[0] for rank, _ in dead}):
                # The first rank to die is usually the cause: a signal (negative code) beats a peer's error exit.
                group = sorted((code >= 0, rank) for rank, code in dead if rank[0] == dp_rank)
                why = "; ".join(f"scheduler rank {self.describe(rank)} exited with code "
                                f"{self.procs[self._index[rank]].exitcode}" for _, rank in group)
                self._fail_rank(dp_rank, why)
                if not self._ready_event.is_set():
                    rank = group[0][1]
                    self._ready[rank] = RankReady(dp_rank=rank[0], tp_rank=rank[1], error=why)
                    self._ready_event.set()

    def _fail_rank(self, rank: int, message: str) -> None:
        if rank not in self._failed:
            self._failed.add(rank)
            logger.error("DP replica %d is down: %s", rank, message)
        for rid, r in list(self.rid_rank.items()):
            if r == rank and rid in self.waiters:
                self.waiters[rid](TokenOut(rid=rid, token_ids=[], finish_reason="abort", error=message,
                                           error_code=ErrorCode.UNAVAILABLE))

    def alive(self) -> bool:
        return not self.closed and all(p.exitcode is None for p in self.procs)

    def stalled_ranks(self, timeout: float) -> dict[str, float]:
        """Ranks ("dp=D tp=T") whose last heartbeat is older than ``timeout`` seconds -> its age (not yet ready:
        none)."""
        now = time.monotonic()
        return {self.describe(self.ranks[i]): now - t for i, t in enumerate(self.last_heartbeat)
                if t and now - t > timeout}

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
            if self.procs[self._index[rank, 0]].exitcode is None:
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
        self._store = None
