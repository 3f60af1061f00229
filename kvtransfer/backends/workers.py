"""The skeleton every backend here shares: per-peer FIFO worker threads (``PeerWorkers``) and the base class that
wires them to the ``KVBackend`` interface (``QueuedBackend``).

Each peer gets one thread that runs ``move(job)`` for its jobs in submission order and reports every job exactly
once through ``events.on_job_done``. ``move`` raises ``TransferError`` (or ``OSError``) on failure.

Pipelined workers (``pipelined=True``, a device backend whose copies are asynchronous): ``move`` enqueues the job's
copies and returns a ``Landing`` (blocks until the bytes are in place) instead of waiting itself. A second thread
per peer, the lander, waits for each landing and reports, in submission order, while the mover already enqueues
the next job: back-to-back jobs keep the copy engine busy instead of idling through each job's report. The peer's
resources are released (``on_stop``) by the lander, after the last landing: no copy still writes into them.

A ``QueuedBackend`` subclass writes its transport only::

    _move(job)              prefill worker thread: move one job's bytes, return once they are in the destination
                            (pipelined: or return a Landing that waits for them)
    _peer_stopped(key)      that peer's worker thread, after its last job: release per-peer resources (optional)
    endpoint/add_peer/remove_peer/close   its own connections, calling super() for the worker side

``submit``/``cancel_room`` come from the base: jobs queue per peer, a cancelled room's queued jobs fail unmoved.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable

from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.backends.base import BackendEvents, KVBackend, PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.wire import layer_buffers

log = logging.getLogger(__name__)

CANCEL_MEMORY_S = 600.0


class TransferError(Exception):
    """A job could not be moved; the message names the peer and the cause."""


class _Stop:
    def __init__(self, reason: str) -> None:
        self.reason = reason


Landing = Callable[[], None]  # blocks until a pipelined job's bytes are in the destination; raises TransferError
_Landed = tuple[TransferJob, Landing | None, str | None]  # mover -> lander: (job, its landing, its error)


class PeerWorkers:
    def __init__(self, events: BackendEvents, move: Callable[[TransferJob], Landing | None], name: str,
                 on_stop: Callable[[PeerKey], None] | None = None, pipelined: bool = False) -> None:
        self._events = events
        self._move = move
        self._on_stop = on_stop  # runs on the peer's thread after its last job (release per-peer resources)
        self._name = name
        self._pipelined = pipelined
        self._lock = threading.Lock()
        self._queues: dict[PeerKey, queue.SimpleQueue[TransferJob | _Stop]] = {}
        self._threads: dict[PeerKey, threading.Thread] = {}
        # Workers of a key still running, the removed ones draining included: a peer removed and added again (it
        # handshook again after losing this rank) has a new worker while the old one drains. The key's resources are
        # released (on_stop) only by the last of them to end, and not while the key is added again.
        self._live: dict[PeerKey, int] = {}
        self._cancelled: dict[int, float] = {}  # room -> when

    def add_peer(self, key: PeerKey) -> None:
        with self._lock:
            if key in self._queues:
                return
            q: queue.SimpleQueue[TransferJob | _Stop] = queue.SimpleQueue()
            thread = threading.Thread(target=self._run, args=(key, q), daemon=True,
                                      name=f"kv-{self._name}-{key.instance_id[-12:]}")
            self._queues[key], self._threads[key] = q, thread
            self._live[key] = self._live.get(key, 0) + 1
        thread.start()

    def submit(self, job: TransferJob) -> None:
        with self._lock:
            q = self._queues.get(job.peer)
        if q is None:  # report on another thread: on_job_done never runs inside submit()
            threading.Thread(target=self._events.on_job_done, daemon=True,
                             args=(job, f"{self._name}: no connection to {job.peer.instance_id}")).start()
            return
        q.put(job)

    def cancel_room(self, room: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._cancelled = {r: t for r, t in self._cancelled.items() if now - t < CANCEL_MEMORY_S}
            self._cancelled[room] = now

    def remove_peer(self, key: PeerKey, reason: str) -> threading.Thread | None:
        with self._lock:
            q = self._queues.pop(key, None)
            thread = self._threads.pop(key, None)
        if q is not None:
            q.put(_Stop(reason))
        return thread

    def close(self, reason: str) -> None:
        with self._lock:
            keys = list(self._queues)
        threads = [self.remove_peer(key, reason) for key in keys]
        for thread in threads:
            if thread is not None and thread is not threading.current_thread():
                thread.join(2)

    def _run(self, key: PeerKey, q: queue.SimpleQueue[TransferJob | _Stop]) -> None:
        landed: queue.SimpleQueue[_Landed | None] | None = None
        lander: threading.Thread | None = None
        if self._pipelined:
            landed = queue.SimpleQueue()
            lander = threading.Thread(target=self._land, args=(key, landed), daemon=True,
                                      name=f"kv-{self._name}-land-{key.instance_id[-12:]}")
            lander.start()
        stopped: str | None = None
        while True:
            try:
                item = q.get(timeout=0.5) if stopped else q.get()
            except queue.Empty:
                if landed is not None and lander is not None:
                    landed.put(None)  # the lander releases the peer after the last landing
                    lander.join()  # so joining this thread (``close``) waits for the copies still landing too
                else:
                    self._ended(key)
                return
            if isinstance(item, _Stop):
                stopped = item.reason
                continue
            error, landing = stopped, None
            if error is None:
                with self._lock:
                    cancelled = item.room in self._cancelled
                if cancelled:
                    error = "cancelled"
                else:
                    try:
                        landing = self._move(item)
                    except Exception as exc:
                        error = self._error(key, item, exc)
            if landed is not None:
                landed.put((item, landing, error))
            else:
                self._report(key, item, landing, error)

    def _land(self, key: PeerKey, landed: queue.SimpleQueue[_Landed | None]) -> None:
        while (entry := landed.get()) is not None:  # the mover always ends the queue with None
            self._report(key, *entry)
        self._ended(key)

    def _ended(self, key: PeerKey) -> None:
        """A worker of ``key`` ran its last job: release the key's resources if no other worker holds them."""
        with self._lock:
            self._live[key] -= 1
            last = self._live[key] == 0 and key not in self._queues
            if self._live[key] == 0:
                del self._live[key]
        if last and self._on_stop is not None:
            self._on_stop(key)

    def _report(self, key: PeerKey, job: TransferJob, landing: Landing | None, error: str | None) -> None:
        if landing is not None and error is None:
            try:
                landing()
            except Exception as exc:
                error = self._error(key, job, exc)
        self._events.on_job_done(job, error)

    def _error(self, key: PeerKey, job: TransferJob, exc: Exception) -> str:
        if isinstance(exc, TransferError | OSError):
            return f"{self._name} to {key.instance_id}: {exc}"
        # a backend bug must fail the job, not kill the peer's worker
        log.error("%s to %s: unexpected error moving room %d", self._name, key.instance_id, job.room, exc_info=exc)
        return f"{self._name} to {key.instance_id}: internal error: {type(exc).__name__}: {exc}"


class QueuedBackend(KVBackend):
    """A backend whose prefill jobs run one at a time per peer on ``PeerWorkers`` threads (see the module docstring).

    Invariant: a peer has a worker (prefill only) from ``add_peer`` until ``remove_peer``/``close``; a job for a
    peer without one fails (reported on another thread), never blocks ``submit``.
    """

    transport = "kv"  # names the worker threads and prefixes job errors
    pipelined = False  # True: ``_move`` may return a ``Landing`` (see the module docstring)

    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        super().__init__(args, config, mode, events, local)
        self._buffers = layer_buffers(args)  # K0, V0, K1, V1, ...
        self._workers = PeerWorkers(events, self._move, self.transport, on_stop=self._peer_stopped,
                                    pipelined=self.pipelined)

    @abstractmethod
    def _move(self, job: TransferJob) -> Landing | None:
        """Worker thread: move ``job``; raises ``TransferError`` (or ``OSError``) naming the cause on failure.
        A pipelined backend may return once the copies are enqueued, with the ``Landing`` that waits for them."""

    def _peer_stopped(self, key: PeerKey) -> None:
        """Worker thread of ``key``, after its last job: nothing of this backend touches its resources again."""

    def add_peer(self, peer: PeerInfo) -> None:
        if self.mode == "prefill":
            self._workers.add_peer(peer.key)

    def remove_peer(self, key: PeerKey) -> None:
        self._workers.remove_peer(key, "peer removed")

    def submit(self, job: TransferJob) -> None:
        self._workers.submit(job)

    def cancel_room(self, room: int) -> None:
        self._workers.cancel_room(room)

    def close(self) -> None:
        self._workers.close("backend closed")
