"""Landing signals of the ``shm`` backend: how a decode rank learns that a copy the prefill rank enqueued has landed,
without the prefill side's report of the landing (``ChunkDone`` after the copy) on the critical path.

The prefill rank makes one ring per decode peer (``add_peer``), exported once in the ``HelloAck``'s endpoint
(``KVBackend.peer_endpoint``) and opened once by the decode rank (its ``add_peer``). Every job of a room whose
``TransferInfo`` asked for signals takes the peer's next sequence number ``seq`` (1, 2, ...): the worker enqueues
the copy, sets ``seq``'s signal behind it and reports the job enqueued (``ChunkDone(signal=seq)`` leaves at once);
the decode rank uses the chunk, and confirms it, only once ``landed(seq)`` is true.

    CudaEventRing   GPU pools: a ring of interprocess CUDA events; ``seq`` is recorded on the peer's copy stream in
                    slot ``(seq - 1) % size`` after the copy. One stream per peer runs its copies in order, so a slot
                    recorded again for a later job completes only after the earlier job's copy too: a query may
                    answer late, never early.
    HostSignalRing  CPU pools: a ``/dev/shm`` file of ``size`` int64 words; after the copy returns the worker writes
                    ``seq`` into slot ``(seq - 1) % size`` (``-seq``: that job failed after it was announced). A
                    word that moved past ``seq`` (the slot's later job) leaves ``seq``'s outcome unknown: an error.

The decode side polls ``landed`` with its room's deadline (``kvtransfer.landing``); ``landed`` raises
``TransferError`` when the signal says the copy will never land.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import threading
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from kvtransfer.backends.base import PeerInfo, PeerKey
from kvtransfer.backends.workers import TransferError

log = logging.getLogger(__name__)

RING_SIZE = 256  # signals per peer ring: more than the jobs of one peer ever in flight at once
_RINGS: weakref.WeakValueDictionary[str, CudaEventRing] = weakref.WeakValueDictionary()  # this process's rings


class CudaEventRing:
    """Prefill side: the events of one decode peer, recorded on that peer's copy stream (its worker thread only)."""

    def __init__(self, device: torch.device, size: int = RING_SIZE) -> None:
        with torch.cuda.device(device):  # each event lives on the pool's device (created at its first record)
            self.events = [torch.cuda.Event(interprocess=True) for _ in range(size)]
            for event in self.events:
                event.record(torch.cuda.current_stream(device))
        self.ring_id = uuid.uuid4().hex
        self._seq = 0
        _RINGS[self.ring_id] = self

    def describe(self) -> dict[str, str]:
        handles = [event.ipc_handle().hex() for event in self.events]
        return {"signals": "cuda_events", "signals_id": self.ring_id, "signal_handles": json.dumps(handles)}

    def record(self, stream: torch.cuda.Stream) -> int:
        """Signal the work enqueued on ``stream`` so far as the next sequence number; returns it."""
        self._seq += 1
        self.events[(self._seq - 1) % len(self.events)].record(stream)
        return self._seq


class CudaEventReader:
    """Decode side: a peer's ring opened in this process (a peer in this same process: its events themselves)."""

    def __init__(self, endpoint: dict[str, str], device: torch.device) -> None:
        own = _RINGS.get(endpoint["signals_id"])
        if own is not None:
            self.events = own.events
        else:
            handles = json.loads(endpoint["signal_handles"])
            self.events = [torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(h)) for h in handles]

    def landed(self, seq: int) -> bool:
        events = self.events
        if not events:
            raise TransferError(f"landing signal {seq} unreadable: the peer's signals were closed")
        try:
            return events[(seq - 1) % len(events)].query()
        except RuntimeError as exc:  # the exporting process died, or the device failed
            raise TransferError(f"landing signal {seq} unreadable: {exc}") from exc

    def close(self) -> None:
        self.events = []


class HostSignalRing:
    """Prefill side: the signal words of one decode peer in a ``/dev/shm`` file (its worker thread writes them)."""

    def __init__(self, directory: Path, prefix: str, size: int = RING_SIZE) -> None:
        self.path = directory / f"{prefix}{os.getpid()}-sig-{uuid.uuid4().hex[:12]}"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size * 8)
            self._mm = mmap.mmap(fd, size * 8)
        finally:
            os.close(fd)
        self.words: np.ndarray | None = np.frombuffer(self._mm, dtype=np.int64)
        self._size = size
        self._seq = 0
        self._lock = threading.Lock()

    def describe(self) -> dict[str, str]:
        return {"signals": "host_words", "signal_path": str(self.path), "signal_words": str(self._size)}

    def next(self) -> int:
        self._seq += 1
        return self._seq

    def set(self, seq: int, landed: bool) -> None:
        """After the job's copy returned (``landed``) or failed: the one write the decode side reads."""
        with self._lock:
            if self.words is None:
                raise TransferError(f"landing signal {seq}: the signals of this peer were closed")
            self.words[(seq - 1) % self._size] = seq if landed else -seq

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        with self._lock:
            if self.words is not None:
                self.words = None
                self._mm.close()


class HostSignalReader:
    """Decode side: a peer's signal words, mapped read-only."""

    def __init__(self, endpoint: dict[str, str]) -> None:
        size = int(endpoint["signal_words"])
        fd = os.open(endpoint["signal_path"], os.O_RDONLY)
        try:
            self._mm = mmap.mmap(fd, size * 8, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.words: np.ndarray | None = np.frombuffer(self._mm, dtype=np.int64)
        self._lock = threading.Lock()

    def landed(self, seq: int) -> bool:
        with self._lock:
            if self.words is None:
                raise TransferError(f"landing signal {seq} unreadable: the peer's signals were closed")
            word = int(self.words[(seq - 1) % len(self.words)])
        if word == seq:
            return True
        if word == -seq:
            raise TransferError(f"the copy of landing signal {seq} failed on the prefill side")
        if abs(word) > seq:
            raise TransferError(f"landing signal {seq} was overwritten by signal {abs(word)} before it was read")
        return False

    def close(self) -> None:
        with self._lock:
            if self.words is not None:
                self.words = None
                self._mm.close()


class SignalReader(Protocol):
    def landed(self, seq: int) -> bool: ...

    def close(self) -> None: ...


class PeerSignalReaders:
    """Decode side: one opened reader per prefill peer whose endpoint offers ``kind`` signals. A peer that handshakes
    again gets its ring opened afresh; one whose ring cannot be opened has none (its chunks come after they land)."""

    def __init__(self, kind: str, open_reader: Callable[[dict[str, str]], SignalReader], enabled: bool) -> None:
        self.kind = kind
        self.enabled = enabled
        self._open_reader = open_reader
        self._lock = threading.Lock()
        self.by_peer: dict[PeerKey, SignalReader] = {}

    def open(self, peer: PeerInfo) -> None:
        self.remove(peer.key)
        if not self.enabled or peer.endpoint.get("signals") != self.kind:
            return
        try:
            reader = self._open_reader(peer.endpoint)
        except (KeyError, OSError, ValueError, RuntimeError) as exc:
            log.warning("kv shm: cannot open the landing signals of %s (%s: %s); its chunks are reported after they "
                        "land", peer.key.instance_id, self.kind, str(exc))  # not exc: its frames hold the mapping
            return
        with self._lock:
            self.by_peer[peer.key] = reader

    def landed_fn(self, key: PeerKey) -> Callable[[int], bool] | None:
        with self._lock:
            reader = self.by_peer.get(key)
        return reader.landed if reader is not None else None

    def remove(self, key: PeerKey) -> None:
        with self._lock:
            reader = self.by_peer.pop(key, None)
        if reader is not None:
            reader.close()

    def close(self) -> None:
        with self._lock:
            readers, self.by_peer = list(self.by_peer.values()), {}
        for reader in readers:
            reader.close()
