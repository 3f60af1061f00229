"""``ucx``: one-sided UCX PUTs (``ucp_put_nbi`` with registered memory and remote keys) straight from the source
page runs into the decode rank's pages; UCX picks the transport (CMA on one host, TCP across hosts, RDMA on
InfiniBand/RoCE, CUDA IPC for GPU buffers where built in). No Python runs per page on the decode side, and on the
prefill side one C call per segment (no future, no message).

    decode rank: its KV buffers registered once (``ucp_mem_map``); a UCX listener; endpoint() publishes
                 {"host", "port", "bases", "buffer_bytes", "rkeys"} (packed remote key of each buffer, hex)
    prefill rank: one endpoint per decode peer, opened by the peer's first job, then  P -> D  DataHello(instance_id,
                 epoch) (decode drops connections from ranks that passed no handshake, and a removed peer's);
                 the peer's remote keys are unpacked on that endpoint
    per job:     write_segments (``onesided``: every page run of every layer, K and V, or head slices) -> one PUT
                 per segment -> ``ucp_ep_flush_nbx``, polled until the bytes are in decode's memory

Threads: every UCX call runs on one asyncio loop thread per process (``ucx_runtime.UcxRuntime``, shared by the
process's UCX backends and stopped with the last of them); the prefill side's per-peer worker threads
(``PeerWorkers``) hand each job to that loop and wait for it, so jobs to one peer complete in submission order and
the scheduler thread never blocks. A job's PUTs and flush go over the peer's ``ucx_connection.Connection``; the UCP
calls ucxx does not wrap go through ``ucp_rma``.

Invariant: a job is reported only after its flush completed, or after its endpoint was aborted and the flush
request finished (no PUT of it in flight): nothing touches its source or destination pages afterwards. The
registration is dropped at close only when no job is still on the loop. Destination pages are checked against the
peer's pool before any PUT (``onesided.write_segments``); the remote keys cover only the registered KV buffers.
Trust: as for ``nixl``: only peers that passed the control-plane handshake (cluster token) learn the keys.

Failure: an error, a removed peer or a job over ``transfer_timeout_s`` aborts the endpoint and marks the peer
broken (later jobs fail at once naming it); a dead peer's endpoint errors out through UCX's error handling (the data
endpoint's error callback: never an unhandled error, which UCX answers by aborting the process).

GPU buffers: UCX moves device memory itself (cuda_copy, cuda_ipc, or RDMA with GPUDirect), never through a host
copy made here. At start-up the backend checks that the process's UCX context has CUDA transports and otherwise
refuses with an error naming the missing support. The forward that wrote the pages (default stream) is
synchronized before the PUTs read them.

Settings (``--kv-transfer-option``, defaults in ``common.kv_backends``): ``ucx_tls`` (default "all": UCX picks per peer and memory type,
InfiniBand and CUDA transports included, as NIXL leaves it; the user's ``UCX_TLS`` wins), ``ucx_progress_mode`` (default "blocking"). Both are per process:
the first UCX backend of a process fixes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import torch
import ucxx

from common.kv_backends import option
from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.backends import ucp_rma as ucp
from kvtransfer.backends import wire
from kvtransfer.backends.base import BackendEvents, PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.devices import memory_kind
from kvtransfer.backends.onesided import RemotePool, pool_endpoint, write_segments
from kvtransfer.backends.ucx_connection import Connection, Target
from kvtransfer.backends.ucx_runtime import CALL_TIMEOUT_S, UcxRuntime
from kvtransfer.backends.workers import QueuedBackend, TransferError

log = logging.getLogger(__name__)



def _resolve_soon(fut: asyncio.Future[None]) -> None:
    """Resolve ``fut`` on its loop, from whichever thread UCX runs an endpoint's close callback on."""
    fut.get_loop().call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))


class UcxBackend(QueuedBackend):
    transport = "ucx"

    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        super().__init__(args, config, mode, events, local)
        opts = config.backend_options
        self._device = args.k_buffers[0].device
        self._cuda = self._device.type == "cuda"
        self._loop = UcxRuntime.acquire(option("ucx", opts, "ucx_tls"), option("ucx", opts, "ucx_progress_mode"),
                                      self._device)
        self._lock = threading.Lock()
        self._closed = False
        self._targets: dict[PeerKey, Target] = {}  # prefill: known decode peers
        self._unusable: dict[PeerKey, str] = {}  # prefill: peers whose endpoint could not be read: why
        self._peers: set[PeerKey] = set()  # decode: prefill ranks that passed the handshake
        # prefill: the loop futures of jobs in flight per peer; a removed peer's are cancelled at once (a connect to
        # a dead peer would otherwise hold its rooms' pages until the connect timeout)
        self._inflight: dict[PeerKey, set[Future[Any]]] = {}
        self._running = 0  # jobs on the loop (the registration stays while any is)
        self._conns: dict[PeerKey, Connection] = {}  # prefill: per decode peer (loop only)
        self._serving: dict[asyncio.Task[None], PeerKey | None] = {}  # decode: one task per connection (loop only)
        self._listener: Any = None
        self._worker_address = ""  # decode: hex of its UCP worker address, for prefill's data endpoints
        self._bases = np.array([buf.data_ptr() for buf in self._buffers], dtype=np.uint64)
        self._buffer_bytes = self._buffers[0].numel() * self._buffers[0].element_size()
        self._regs: list[ucp.Registration] = []
        self._packed: list[bytes] = []
        try:
            if self._cuda:
                self._check_cuda_transports()
            self._call(self._register())
            if mode == "decode":
                self._call(self._listen())
        except BaseException:
            with contextlib.suppress(Exception):
                self._call(self._unregister())
            UcxRuntime.release()
            raise

    # ---- interface ---------------------------------------------------------------------------------------------
    def endpoint(self) -> dict[str, str]:
        """Decode: the listener's address, the pool's buffers and their remote keys; prefill: the memory kind."""
        ep = {"memory": memory_kind(self._device)}
        if self._listener is not None:
            ep.update(host=self.config.advertised_host, port=str(self._listener.port), worker=self._worker_address,
                      rkeys=",".join(k.hex() for k in self._packed), **pool_endpoint(self._bases, self._buffer_bytes))
        return ep

    def add_peer(self, peer: PeerInfo) -> None:
        with self._lock:
            if self._closed:
                return
            if self.mode == "decode":
                self._peers.add(peer.key)
        if self.mode == "prefill":
            try:
                ep = peer.endpoint
                rkeys = [bytes.fromhex(k) for k in ep["rkeys"].split(",")]
                target = Target(peer, RemotePool.of(peer, len(self._buffers)), rkeys)
                if len(rkeys) != len(self._buffers) or "port" not in ep or "worker" not in ep:
                    raise ValueError(f"{len(rkeys)} remote keys for {len(self._buffers)} KV buffers")
            except (KeyError, ValueError) as exc:
                log.warning("kv ucx: unusable endpoint of %s (%s); its jobs will fail", peer.key.instance_id, exc)
                with self._lock:
                    self._unusable[peer.key] = f"{type(exc).__name__}: {exc}"
            else:
                with self._lock:
                    self._targets[peer.key] = target
                    self._unusable.pop(peer.key, None)
        super().add_peer(peer)

    def remove_peer(self, key: PeerKey) -> None:
        with self._lock:
            self._targets.pop(key, None)
            self._unusable.pop(key, None)
            self._peers.discard(key)
            inflight = self._inflight.pop(key, set())
            closed = self._closed
        for future in inflight:
            future.cancel()
        super().remove_peer(key)
        if not closed:
            self._on_loop(self._drop_connections, key)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._targets.clear()
            self._peers.clear()
        try:
            self._call(self._shutdown())
        finally:
            super().close()
            with self._lock:
                running = self._running
            try:
                if running:  # NOTE: its pages stay registered (untouchable) until the process exits
                    log.warning("kv ucx: %d job(s) still running at close; the KV buffers stay registered", running)
                else:
                    self._call(self._unregister())
            finally:
                UcxRuntime.release()

    def _check_cuda_transports(self) -> None:
        async def transports() -> set[str]:
            return set(ucxx.get_active_transports())

        active = self._call(transports())
        if not any(t.startswith("cuda") for t in active):
            raise ValueError(
                f"the ucx backend was given GPU KV buffers but this process's UCX has no CUDA transport (active: "
                f"{', '.join(sorted(active)) or 'none'}): install a CUDA build of ucxx (ucxx-cu12) and keep "
                "cuda_copy/cuda_ipc in UCX_TLS, or use --kv-transfer-backend shm (same host) or tcp (staged)")

    # ---- loop-thread plumbing ----------------------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = CALL_TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _on_loop(self, fn: Callable[[PeerKey], None], key: PeerKey) -> None:
        """Run ``fn(key)`` on the loop soon; a no-op once the process's UCX runtime has stopped."""
        with contextlib.suppress(RuntimeError):  # loop closed: nothing left to drop
            self._loop.call_soon_threadsafe(fn, key)

    async def _register(self) -> None:
        for base in self._bases:
            self._regs.append(ucp.Registration(int(base), self._buffer_bytes))
        self._packed = [reg.pack() for reg in self._regs] if self.mode == "decode" else []

    async def _unregister(self) -> None:
        regs, self._regs = self._regs, []
        for reg in regs:
            try:
                reg.unmap()
            except ucp.UcpError as exc:
                log.warning("kv ucx: deregistering a KV buffer failed: %s", exc)

    async def _listen(self) -> None:
        self._listener = ucxx.create_listener(self._serve, port=0)
        self._worker_address = ucxx.get_worker_address().tobytes().hex()

    async def _shutdown(self) -> None:
        for key in list(self._conns):
            self._drop_connections(key)
        tasks = list(self._serving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _drop_connections(self, key: PeerKey, target: Target | None = None) -> None:
        """Loop thread: abort the endpoint to ``key`` (its remote keys first; only if it was opened for ``target``
        when one is named) and stop serving its connections."""
        conn = self._conns.get(key)
        if conn is not None and (target is None or conn.target is target):
            del self._conns[key]
            conn.close()
        for task, peer in list(self._serving.items()):
            if peer == key:
                task.cancel()

    # ---- prefill: the peer's worker thread waits for its job on the loop ----------------------------------------
    def _move(self, job: TransferJob) -> None:
        with self._lock:
            target, why = self._targets.get(job.peer), self._unusable.get(job.peer)
            broken = target.broken if target is not None else None
        if target is None:
            raise TransferError(f"the peer's UCX endpoint is unknown: {why or 'peer removed'}")
        if broken is not None:
            raise TransferError(f"connection broken earlier: {broken}")
        if not job.runs:
            return
        # raises before anything is written when a page or head falls outside the peer's pool
        segments = write_segments(self.args, self._bases, self._buffers[0].element_size(), target.pool, job)
        with self._lock:
            if self._closed:
                raise TransferError("backend closed")
            self._running += 1
        try:
            self._run_on_loop(job, target, segments)
        finally:
            with self._lock:
                self._running -= 1

    def _run_on_loop(self, job: TransferJob, target: Target, segments: tuple[np.ndarray, ...]) -> None:
        started, left = threading.Event(), threading.Event()  # the job's coroutine entered / left the loop
        future = asyncio.run_coroutine_threadsafe(self._move_async(job, target, segments, started, left), self._loop)
        with self._lock:
            self._inflight.setdefault(job.peer, set()).add(future)
        future.add_done_callback(lambda f, peer=job.peer: self._forget(peer, f))
        try:
            future.result(self.config.transfer_timeout_s)
            return
        except FutureCancelled:
            reason = f"room {job.room} chunk {job.chunk_id}: peer removed"
        except FutureTimeout as exc:
            if not future.cancel():  # done: the job itself raised a TimeoutError (e.g. connecting)
                reason = f"room {job.room} chunk {job.chunk_id}: {type(exc).__name__}: {exc}"
            else:
                reason = f"room {job.room} chunk {job.chunk_id}: not flushed within {self.config.transfer_timeout_s}s"
        except Exception as exc:  # whatever ended the job is its failure (reported, never swallowed)
            reason = f"room {job.room} chunk {job.chunk_id}: {type(exc).__name__}: {exc}"
        # NOTE: the task's cancellation was queued on the loop before this barrier: a coroutine that has not started
        # by then never runs; one that has aborts its endpoint and sets ``left`` once no PUT of it is in flight.
        with contextlib.suppress(FutureTimeout, RuntimeError):
            self._call(asyncio.sleep(0))
        if started.is_set() and not left.wait(CALL_TIMEOUT_S):
            log.error("kv ucx: room %d chunk %d still on the loop after its end", job.room, job.chunk_id)
        with self._lock:
            if target.broken is None:
                target.broken = reason
        self._on_loop(lambda key: self._drop_connections(key, target), job.peer)
        raise TransferError(reason)

    def _forget(self, peer: PeerKey, future: Future[Any]) -> None:
        with self._lock:
            self._inflight.get(peer, set()).discard(future)

    async def _move_async(self, job: TransferJob, target: Target, segments: tuple[np.ndarray, ...],
                          started: threading.Event, left: threading.Event) -> None:
        started.set()
        try:
            conn = await self._connection(job.peer, target)
            if self._cuda:  # the forward that wrote the pages
                torch.cuda.default_stream(self._device).synchronize()
            conn.put(job, segments)  # NOTE: no await between the PUTs and the flush: conn stays open
            await conn.flush(job, lambda: self._drop_connections(job.peer, conn.target))
        finally:
            left.set()

    async def _connection(self, key: PeerKey, target: Target) -> Connection:
        conn = self._conns.get(key)
        if conn is not None and conn.target is target:
            return conn
        if conn is not None:  # opened for an earlier pairing with the same key
            self._drop_connections(key)

        def wanted() -> bool:
            with self._lock:
                return not self._closed and self._targets.get(key) is target

        conn = await Connection.open(target, self.local, min(self.config.bootstrap_timeout_s, 30.0), wanted)
        self._conns[key] = conn
        return conn


    # ---- decode: one task per incoming connection --------------------------------------------------------------
    async def _serve(self, ep: Any) -> None:
        """Admit a prefill rank that passed the handshake; hold its connection until either side ends it."""
        task = asyncio.current_task()
        assert task is not None
        self._serving[task] = None
        try:
            hello = wire.decode(await asyncio.wait_for(ep.recv_obj(), self.config.bootstrap_timeout_s))
            if not isinstance(hello, wire.DataHello):
                raise TransferError(f"expected DataHello, got {type(hello).__name__}")
            key = PeerKey(hello.instance_id, hello.epoch)
            await self._await_peer(key)
            self._serving[task] = key
            # NOTE: the connection is held by a close callback, not a pending receive: outside ucxx's thread
            # progress modes a pending request is polled (``wait_yield``), which would keep this loop spinning.
            closed = asyncio.get_running_loop().create_future()
            ep.set_close_callback(_resolve_soon, (closed,))
            if not ep.closed:  # else it closed before the callback was set
                await closed
            raise TransferError("the prefill side closed it")
        except Exception as exc:  # the connection ends; the prefill side fails its jobs (logged, not swallowed)
            log.info("kv ucx: data connection closed: %s: %s", type(exc).__name__, exc)
        finally:
            self._serving.pop(task, None)
            ep.abort()

    async def _await_peer(self, key: PeerKey) -> None:
        """The prefill side may connect before this side's add_peer for it ran; wait for it (bounded)."""
        end = time.monotonic() + self.config.bootstrap_timeout_s
        while True:
            with self._lock:
                if self._closed:
                    raise TransferError("backend closed")
                if key in self._peers:
                    return
            if time.monotonic() > end:
                raise TransferError(f"data connection from {key.instance_id} which passed no handshake")
            await asyncio.sleep(0.01)
