"""``ucx``: KV pages over UCX tag messages (``ucxx``, its asyncio API), straight from the source page runs into the
destination page runs; UCX picks the transport (CMA/shared memory on one host, TCP across hosts, CUDA IPC or
RDMA for GPU buffers where built in).

    decode rank: a UCX listener, address in endpoint() {"host", "port"}
    prefill rank: one endpoint per decode peer, opened by the peer's first job
    per connection:  P -> D  DataHello(instance_id, epoch)                               once
    per job:         P -> D  ChunkHeader;  payload: for layer: for K, V: for run: one tag message
                     D -> P  ChunkAck      after every payload message landed         (see ``_twosided``)

Threads: all UCX calls run on one asyncio loop thread per process (``_Runtime``, shared by the process's UCX
backends and stopped with the last of them); the prefill side's per-peer worker threads (``PeerWorkers``) hand
each job to that loop and wait for it, so jobs to one peer complete in submission order and the scheduler thread
never blocks. Within one endpoint and tag UCX matches messages in posting order, which keeps header and payload
aligned without per-message tags.

Failure: an error or a job over ``transfer_timeout_s`` aborts the endpoint and marks the peer broken (later jobs
fail at once naming it); a dead peer's endpoint errors out through UCX's error handling.

GPU buffers: UCX moves device memory itself (cuda_copy, cuda_ipc, or RDMA with GPUDirect), never through a
host copy made here. At start-up the backend checks that the process's UCX context has CUDA transports and
otherwise refuses with an error naming the missing support (and ``shm``/``tcp`` as the backends that move GPU
buffers without it). Device work (packing, scattering) runs on the default stream and is synchronized before
UCX reads a buffer and before the ack.

Settings (``KVTransferConfig.backend_options``): ``ucx_tls`` (default "sm,tcp", with "cuda_copy,cuda_ipc" added
for GPU buffers: "sm" alone cannot connect; the user's ``UCX_TLS`` wins), ``ucx_progress_mode`` (default
"blocking", fastest on few cores). Both are per process: the first UCX backend of a process fixes them.
``pack_bytes`` (default 4 MiB: runs under 1 MiB travel packed in staging messages, which doubled paged throughput
here; see ``_twosided``; 0 = one message per run and layer).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import ucxx
from ucxx.exceptions import UCXError

from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.backends import _twosided as twosided
from kvtransfer.backends import wire
from kvtransfer.backends.base import BackendEvents, PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.workers import QueuedBackend, TransferError

log = logging.getLogger(__name__)

DEFAULT_TLS = "sm,tcp"
CUDA_TLS = "cuda_copy,cuda_ipc"
DEFAULT_PROGRESS = "blocking"
CALL_TIMEOUT_S = 10.0  # loop-thread housekeeping calls (listen, abort, shutdown)
STAGING_WINDOW = 64 << 20  # per job and side: staged payload bytes in flight (see _twosided's packing)
DEFAULT_PACK_BYTES = 4 << 20


class _Runtime:
    """The process's UCX context and the event loop thread it progresses on (refcounted by backends)."""

    _lock = threading.Lock()
    _users = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, tls: str, progress_mode: str, device: torch.device) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None:
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


def _buffer(t: torch.Tensor) -> Any:
    """A zero-copy UCX-sendable view of a contiguous tensor (numpy for host memory, CUDA array interface else)."""
    flat = wire.as_bytes(t)
    return flat.numpy() if flat.device.type == "cpu" else flat


class UcxBackend(QueuedBackend):
    transport = "ucx"

    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        super().__init__(args, config, mode, events, local)
        opts = config.backend_options
        self._pack_bytes = int(opts.get("pack_bytes", DEFAULT_PACK_BYTES))
        self._device = args.k_buffers[0].device
        self._cuda = self._device.type == "cuda"
        default_tls = f"{DEFAULT_TLS},{CUDA_TLS}" if self._cuda else DEFAULT_TLS
        self._loop = _Runtime.acquire(opts.get("ucx_tls", default_tls),
                                      opts.get("ucx_progress_mode", DEFAULT_PROGRESS), self._device)
        if self._cuda:
            try:
                self._check_cuda_transports()
            except BaseException:
                _Runtime.release()
                raise
        self._lock = threading.Lock()
        self._closed = False
        self._peers: dict[PeerKey, PeerInfo] = {}
        self._broken: dict[PeerKey, str] = {}
        # prefill: the loop futures of jobs in flight per peer; a removed peer's are cancelled at once (a connect to
        # a dead peer would otherwise hold its rooms' pages until the connect timeout)
        self._inflight: dict[PeerKey, set[Future[Any]]] = {}
        self._eps: dict[PeerKey, Any] = {}  # prefill: endpoint per decode peer (touched on the loop only)
        self._serving: dict[asyncio.Task[None], PeerKey | None] = {}  # decode: one task per connection (loop only)
        self._listener: Any = None
        if mode == "decode":
            try:
                self._call(self._listen())
            except BaseException:
                _Runtime.release()
                raise

    # ---- interface ---------------------------------------------------------------------------------------------
    def endpoint(self) -> dict[str, str]:
        """Decode: the listener's address; prefill: nothing (it connects out)."""
        if self._listener is None:
            return {}
        return {"host": self.config.advertised_host, "port": str(self._listener.port)}

    def add_peer(self, peer: PeerInfo) -> None:
        with self._lock:
            if self._closed:
                return
            self._peers[peer.key] = peer
        super().add_peer(peer)

    def remove_peer(self, key: PeerKey) -> None:
        with self._lock:
            self._peers.pop(key, None)
            self._broken.pop(key, None)
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
            self._peers.clear()
        try:
            self._call(self._shutdown())
        finally:
            super().close()
            _Runtime.release()

    def _check_cuda_transports(self) -> None:
        async def transports() -> set[str]:
            return set(ucxx.get_active_transports())

        active = self._call(transports())
        if not any(t.startswith("cuda") for t in active):
            raise ValueError(
                f"the ucx backend was given GPU KV buffers but this process's UCX has no CUDA transport (active: "
                f"{', '.join(sorted(active)) or 'none'}): install a CUDA build of ucxx (ucxx-cu12) and keep "
                "cuda_copy/cuda_ipc in UCX_TLS, or use --kv-transfer-backend shm (same host) or tcp (staged)")

    def _sync(self) -> None:
        """Device work enqueued so far (forward pass, packing, scattering) is done: UCX may read or ack."""
        if self._cuda:
            torch.cuda.default_stream(self._device).synchronize()

    # ---- loop-thread plumbing ----------------------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = CALL_TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _on_loop(self, fn: Callable[[PeerKey], None], key: PeerKey) -> None:
        """Run ``fn(key)`` on the loop soon; a no-op once the process's UCX runtime has stopped."""
        with contextlib.suppress(RuntimeError):  # loop closed: nothing left to drop
            self._loop.call_soon_threadsafe(fn, key)

    async def _listen(self) -> None:
        self._listener = ucxx.create_listener(self._serve, port=0)

    async def _shutdown(self) -> None:
        for key in list(self._eps):
            self._drop_connections(key)
        tasks = list(self._serving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _drop_connections(self, key: PeerKey) -> None:
        """Loop thread: abort the endpoint to ``key`` and stop serving its connections."""
        ep = self._eps.pop(key, None)
        if ep is not None:
            ep.abort()
        for task, peer in list(self._serving.items()):
            if peer == key:
                task.cancel()

    # ---- prefill: the peer's worker thread waits for its job on the loop ----------------------------------------
    def _move(self, job: TransferJob) -> None:
        with self._lock:
            broken, known = self._broken.get(job.peer), job.peer in self._peers
        if not known:
            raise TransferError("peer removed")
        if broken is not None:
            raise TransferError(f"connection broken earlier: {broken}")
        future = asyncio.run_coroutine_threadsafe(self._move_async(job), self._loop)
        with self._lock:
            self._inflight.setdefault(job.peer, set()).add(future)
        future.add_done_callback(lambda f, peer=job.peer: self._forget(peer, f))
        try:
            ack = future.result(self.config.transfer_timeout_s)
        except FutureCancelled:
            raise TransferError(f"room {job.room} chunk {job.chunk_id}: peer removed") from None
        except FutureTimeout as exc:
            if not future.cancel():  # done: the job itself raised a TimeoutError (e.g. connecting)
                reason = f"room {job.room} chunk {job.chunk_id}: {type(exc).__name__}: {exc}"
            else:
                reason = f"room {job.room} chunk {job.chunk_id}: no ack within {self.config.transfer_timeout_s}s"
        except Exception as exc:  # whatever ended the job is its failure (reported, never swallowed)
            reason = f"room {job.room} chunk {job.chunk_id}: {type(exc).__name__}: {exc}"
        else:
            if not ack.error:
                return
            # NOTE: the refused payload was never read; the connection cannot be reused.
            reason = f"decode refused room {job.room} chunk {job.chunk_id}: {ack.error}"
        with self._lock:
            self._broken.setdefault(job.peer, reason)
        self._on_loop(self._drop_connections, job.peer)
        raise TransferError(reason)

    def _forget(self, peer: PeerKey, future: Future[Any]) -> None:
        with self._lock:
            self._inflight.get(peer, set()).discard(future)

    async def _move_async(self, job: TransferJob) -> wire.ChunkAck:
        ep = await self._endpoint(job.peer)
        header, msgs = twosided.source_messages(self.args, job, self._pack_bytes)
        self._sync()  # the pages' forward pass
        await ep.send_obj(wire.encode(header))
        sends: deque[tuple[asyncio.Future[Any], int]] = deque()  # in posting order, with staged bytes
        try:
            staged = 0
            for msg in msgs:
                tensor = msg.gather()
                if not msg.direct:
                    self._sync()
                sends.append((asyncio.ensure_future(ep.send(_buffer(tensor))), 0 if msg.direct else msg.nbytes))
                staged += sends[-1][1]
                while staged > STAGING_WINDOW:  # bounds staging memory
                    send, done = sends.popleft()
                    await send
                    staged -= done
            ack = wire.decode(await ep.recv_obj())
            if not isinstance(ack, wire.ChunkAck) or (ack.room, ack.chunk_id) != (job.room, job.chunk_id):
                raise TransferError(f"unexpected reply {ack!r}")
            if not ack.error:  # a refused payload is never received: its sends are cancelled below
                while sends:
                    await sends.popleft()[0]
            return ack
        finally:
            for send, _ in sends:
                send.cancel()
            await asyncio.gather(*(send for send, _ in sends), return_exceptions=True)

    async def _endpoint(self, key: PeerKey) -> Any:
        ep = self._eps.get(key)
        if ep is not None:
            return ep
        with self._lock:
            peer = self._peers.get(key)
        if peer is None or "port" not in peer.endpoint:
            raise TransferError(f"peer has no ucx endpoint: {peer.endpoint if peer else 'removed'}")
        ep = await ucxx.create_endpoint(peer.endpoint["host"], int(peer.endpoint["port"]),
                                       connect_timeout=min(self.config.bootstrap_timeout_s, 30.0))
        await ep.send_obj(wire.encode(wire.DataHello(self.local.instance_id, self.local.epoch)))
        with self._lock:
            gone = self._closed or key not in self._peers
        if gone:
            ep.abort()
            raise TransferError("peer removed")
        self._eps[key] = ep
        return ep

    # ---- decode: one task per incoming connection --------------------------------------------------------------
    async def _serve(self, ep: Any) -> None:
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
            while True:
                header = wire.decode(await ep.recv_obj())
                if not isinstance(header, wire.ChunkHeader):
                    raise TransferError(f"expected ChunkHeader, got {type(header).__name__}")
                await self._receive(ep, header)
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

    async def _receive(self, ep: Any, header: wire.ChunkHeader) -> None:
        """Land one job's payload in the pool, then ack; a refused header is acked with the reason and the
        connection dropped (its payload is never read, so nothing of it is written)."""
        try:
            msgs = twosided.destination_messages(self.args, header)
        except twosided.RefusedHeader as exc:
            await ep.send_obj(wire.encode(wire.ChunkAck(header.room, header.chunk_id, str(exc))))
            raise TransferError(f"refused room {header.room} chunk {header.chunk_id}: {exc}") from exc
        recvs: deque[tuple[asyncio.Future[Any], twosided.Message, torch.Tensor]] = deque()  # in posting order
        try:
            staged = 0
            for msg in msgs:
                landing = msg.landing()
                recvs.append((asyncio.ensure_future(ep.recv(_buffer(landing))), msg, landing))
                staged += 0 if msg.direct else msg.nbytes
                while recvs and (staged > STAGING_WINDOW or msg is msgs[-1]):
                    recv, done, landed = recvs.popleft()
                    await recv
                    done.scatter(landed)
                    staged -= 0 if done.direct else done.nbytes
        finally:
            for recv, _, _ in recvs:
                recv.cancel()
            await asyncio.gather(*(recv for recv, _, _ in recvs), return_exceptions=True)
        self._sync()  # scattered staging is in the pool before the ack
        await ep.send_obj(wire.encode(wire.ChunkAck(header.room, header.chunk_id)))
