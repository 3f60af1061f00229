"""Per-peer FIFO worker threads shared by the simple backends (fake, tcp, shm).

Each peer gets one thread that runs ``move(job)`` for its jobs in submission order and reports every job exactly
once through ``events.on_job_done``. ``move`` raises ``TransferError`` (or ``OSError``) on failure.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from kvtransfer.backends.base import BackendEvents, PeerKey, TransferJob

log = logging.getLogger(__name__)

CANCEL_MEMORY_S = 600.0


class TransferError(Exception):
    """A job could not be moved; the message names the peer and the cause."""


class _Stop:
    def __init__(self, reason: str) -> None:
        self.reason = reason


class PeerWorkers:
    def __init__(self, events: BackendEvents, move: Callable[[TransferJob], None], name: str,
                 on_stop: Callable[[PeerKey], None] | None = None) -> None:
        self._events = events
        self._move = move
        self._on_stop = on_stop  # runs on the peer's thread after its last job (release per-peer resources)
        self._name = name
        self._lock = threading.Lock()
        self._queues: dict[PeerKey, queue.SimpleQueue[TransferJob | _Stop]] = {}
        self._threads: dict[PeerKey, threading.Thread] = {}
        self._cancelled: dict[int, float] = {}  # room -> when

    def add_peer(self, key: PeerKey) -> None:
        with self._lock:
            if key in self._queues:
                return
            q: queue.SimpleQueue[TransferJob | _Stop] = queue.SimpleQueue()
            thread = threading.Thread(target=self._run, args=(key, q), daemon=True,
                                      name=f"kv-{self._name}-{key.instance_id[-12:]}")
            self._queues[key], self._threads[key] = q, thread
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
        stopped: str | None = None
        while True:
            try:
                item = q.get(timeout=0.5) if stopped else q.get()
            except queue.Empty:
                if self._on_stop is not None:
                    self._on_stop(key)
                return
            if isinstance(item, _Stop):
                stopped = item.reason
                continue
            error = stopped
            if error is None:
                with self._lock:
                    cancelled = item.room in self._cancelled
                if cancelled:
                    error = "cancelled"
                else:
                    try:
                        self._move(item)
                    except (TransferError, OSError) as exc:
                        error = f"{self._name} to {key.instance_id}: {exc}"
                    except Exception as exc:  # a backend bug must fail the job, not kill the peer's worker
                        log.exception("%s to %s: unexpected error moving room %d", self._name, key.instance_id,
                                      item.room)
                        error = f"{self._name} to {key.instance_id}: internal error: {type(exc).__name__}: {exc}"
            self._events.on_job_done(item, error)
