"""Decode side: chunks whose ``ChunkDone`` left the prefill rank when their copy was enqueued (``signal`` > 0, see
``kvtransfer/backends/signals.py``), held per room until their landing signal is set; then the room logic takes
them (``DecodeRooms._chunk_done``) as if the ChunkDone had come after the landing.

The control thread reads a chunk's signal when its ChunkDone arrives (a device copy has usually landed by then);
a room whose first held chunk is still in flight goes to the watcher thread, which polls the signals of every
waiting room (backing off from ``POLL_MIN_S`` to ``POLL_MAX_S``) and hands the room back to the control thread
once that signal is set or failed, or the room is final; the confirmations that makes leave at once (``flush``). A waiting room is bounded by its own deadline (it fails
in ``DecodeRooms.tick``, or when its peer is lost, and the watcher then drops it).

Invariant: a room's chunks reach the room logic in the order their ChunkDones arrived, each only after its copy
landed; a signal that says the copy will never land fails the room naming the prefill rank.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvtransfer.backends.base import PeerKey
from kvtransfer.backends.workers import TransferError
from kvtransfer.messages import ChunkDone
from kvtransfer.poll import KVPoll

if TYPE_CHECKING:
    from kvtransfer.manager import KVManager

POLL_MIN_S = 0.00002
POLL_MAX_S = 0.0002  # a landing is seen at most this late; a device copy of 512 MiB takes about this long



class RecvRoom(Protocol):  # what is read here of ``decode_rooms.RecvRoom`` (which imports this module)
    room: int
    state: KVPoll


class Source(Protocol):  # of ``decode_rooms.Source``
    key: PeerKey | None


Take = Callable[[Any, Any, ChunkDone, float], None]  # the room logic's own RecvRoom and Source, handed back
Fail = Callable[[Any, str, float], None]
Flush = Callable[[], None]


class LandingWatch:
    def __init__(self, mgr: KVManager, take: Take, fail: Fail, flush: Flush) -> None:
        self.mgr = mgr
        self._take, self._fail, self._flush = take, fail, flush
        self.held: dict[int, deque[tuple[RecvRoom, Source, ChunkDone]]] = {}  # room -> its chunks, under mgr.lock
        self._cond = threading.Condition()
        self._waiting: dict[int, tuple[RecvRoom, Callable[[], bool]]] = {}  # room -> its first held chunk's signal
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---- control thread ---------------------------------------------------------------------------------------
    def chunk(self, rec: RecvRoom, source: Source, msg: ChunkDone, now: float) -> None:
        """A ChunkDone of ``rec`` from ``source`` (``mgr.lock`` held)."""
        if msg.signal == 0 and rec.room not in self.held:
            self._take(rec, source, msg, now)
            return
        self.held.setdefault(rec.room, deque()).append((rec, source, msg))
        self.drain(rec.room)

    def drain(self, room: int) -> None:
        """Pass the room's held chunks that landed on, in order; watch the first that has not."""
        with self.mgr.lock:
            queue = self.held.get(room, deque())
            while queue:
                rec, source, msg = queue[0]
                if rec.state.is_final:  # a failed room's chunks are dropped (never a later room's of that id)
                    queue.popleft()
                    continue
                reader = self.mgr.backend.signal_reader(source.key) if source.key is not None else None
                try:
                    if msg.signal:
                        if reader is None:
                            raise TransferError("it sent a landing signal this rank did not ask for or cannot read")
                        if not reader(msg.signal):
                            self._watch(rec, lambda r=reader, s=msg.signal: r(s))
                            return
                except TransferError as exc:
                    self._fail(rec, f"room {rec.room}: chunk {msg.chunk_id} from prefill {source.key}: {exc}",
                               time.monotonic())
                    continue
                queue.popleft()
                self._take(rec, source, msg, time.monotonic())
            self.held.pop(room, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2)

    # ---- watcher thread ---------------------------------------------------------------------------------------
    def _watch(self, rec: RecvRoom, landed: Callable[[], bool]) -> None:
        with self._cond:
            if self._closed:
                return
            self._waiting[rec.room] = (rec, landed)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"kv-landing-{self.mgr.instance_id[-20:]}")
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        delay = POLL_MIN_S
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                waiting = list(self._waiting.items())
            ready = [room for room, (rec, landed) in waiting if rec.state.is_final or _settled(landed)]
            if not ready:
                time.sleep(delay)
                delay = min(delay * 2, POLL_MAX_S)
                continue
            delay = POLL_MIN_S
            with self._cond:
                for room in ready:  # drain() watches the room again if its next chunk is still in flight
                    self._waiting.pop(room, None)
            self.mgr.control.call_soon(lambda rooms=ready: self._drain_all(rooms))

    def _drain_all(self, rooms: list[int]) -> None:
        """Control thread: the watched rooms that moved; their confirmations leave together (no message arrived to
        flush them)."""
        for room in rooms:
            self.drain(room)
        self._flush()


def _settled(landed: Callable[[], bool]) -> bool:
    """The signal is set, or reading it failed (the control thread reads the failure again and fails the room)."""
    try:
        return landed()
    except TransferError:
        return True
