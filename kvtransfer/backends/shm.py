"""``shm``: same-host shared memory, chosen by the buffers' device. GPU buffers: CUDA IPC (``shm_cuda``). CPU
buffers (this module): the decode rank's KV pool lives in one ``/dev/shm`` file; the prefill rank maps it and
copies each page run straight into the destination pages (one ``memmove`` per run per layer, K and V).

Decode side, at construction: the pool's K/V tensors are re-homed into the shared file with ``Tensor.set_`` (their
contents are copied first), so every existing reference to them (the KV pool, the model runner) keeps working
and now points at shared memory. A buffer that is a leading slice of a larger tensor (a draft's pool: the slots
under the target's numbering, then its own) moves with that whole tensor, which its other users read. Layout of the
file: K0 | V0 | K1 | V1 | ... each ``layer_bytes`` long (the largest such tensor).
The file is unlinked when the manager closes; files of dead processes are swept at the next start.
Completion: a memmove is synchronous, so a job is done when its copies return (no confirmation needed). With
landing signals (``landing_signal=on``; ``auto`` leaves them to GPU pools, ``off`` is the default: on 2 loaded cores they cost
more than they save; ``backends/signals.py``) the prefill rank makes a signal file
per decode peer and announces a signalled job before its copies (``on_job_enqueued``), then writes the job's signal
word after them: the decode rank's ``ChunkDone`` travels while the copies run.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.kv_backends import option
from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.backends.base import BackendEvents, KVBackend, PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.signals import HostSignalReader, HostSignalRing, PeerSignalReaders
from kvtransfer.backends.workers import QueuedBackend, TransferError
from kvtransfer.pages import copy_runs

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "pdcluster-kv-"


@dataclass
class _Mapping:
    """A decode peer's shared pool, mapped into this (prefill) process."""

    mm: mmap.mmap
    array: np.ndarray  # uint8 over the whole file (holds the buffer export until released)
    base: int  # address of byte 0
    layer_bytes: int
    num_pages: int
    kv_heads: int


def _home(buf: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``buf`` is: itself, or the contiguous tensor it is a leading slice of."""
    base = buf._base
    if base is None:
        return buf
    if not base.is_contiguous() or buf.data_ptr() != base.data_ptr():
        raise ValueError("kv shm: a KV buffer that is a view must be a leading slice of a contiguous tensor")
    return base


def _sweep_stale() -> None:
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        match = re.match(rf"{PREFIX}(\d+)-", path.name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            log.info("kv shm: removed stale segment %s of a dead process", path)
        except PermissionError:
            pass  # alive, someone else's


class ShmBackend(KVBackend):
    """The ``shm`` backend: delegates to the implementation for the buffers' device."""

    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        super().__init__(args, config, mode, events, local)
        device = args.k_buffers[0].device.type
        if device == "cuda":
            from kvtransfer.backends.shm_cuda import CudaIpcBackend
            self.impl: KVBackend = CudaIpcBackend(args, config, mode, events, local)
        elif device == "cpu":
            self.impl = ShmFileBackend(args, config, mode, events, local)
        else:
            raise ValueError(f"the shm backend moves CPU or CUDA KV buffers, not {device}; use tcp")

    def endpoint(self) -> dict[str, str]:
        return self.impl.endpoint()

    def add_peer(self, peer: PeerInfo) -> None:
        self.impl.add_peer(peer)

    def peer_endpoint(self, key: PeerKey) -> dict[str, str]:
        return self.impl.peer_endpoint(key)

    def signal_reader(self, key: PeerKey) -> Callable[[int], bool] | None:
        return self.impl.signal_reader(key)

    def remove_peer(self, key: PeerKey) -> None:
        self.impl.remove_peer(key)

    def submit(self, job: TransferJob) -> None:
        self.impl.submit(job)

    def cancel_room(self, room: int) -> None:
        self.impl.cancel_room(room)

    def close(self) -> None:
        self.impl.close()


class ShmFileBackend(QueuedBackend):
    """CPU buffers through one ``/dev/shm`` file per decode rank."""

    transport = "shm"

    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        super().__init__(args, config, mode, events, local)
        self._homes = [_home(buf) for buf in self._buffers]
        self._layer_bytes = max(h.numel() * h.element_size() for h in self._homes)
        self._lock = threading.Lock()
        self._maps: dict[PeerKey, _Mapping] = {}
        self._unmapped: dict[PeerKey, str] = {}  # peers whose pool could not be mapped: why
        self._path: Path | None = None
        self._signals = option("shm", config.backend_options, "landing_signal") == "on"  # auto: GPU pools only
        self._rings: dict[PeerKey, HostSignalRing] = {}  # prefill: each decode peer's signal words
        self._signal_readers = PeerSignalReaders("host_words", HostSignalReader, self._signals)  # decode
        if mode == "decode":
            self._path = self._share_pool()

    def _share_pool(self) -> Path:
        _sweep_stale()
        path = SHM_DIR / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        size = self._layer_bytes * len(self._buffers)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        shared = torch.frombuffer(self._mm, dtype=torch.uint8)
        for i, (buf, home) in enumerate(zip(self._buffers, self._homes, strict=True)):
            start = i * self._layer_bytes
            shared[start:start + home.numel() * home.element_size()].copy_(home.reshape(-1).view(torch.uint8))
            # NOTE: set_ rebinds the tensor object in place; every holder of it now sees the shared memory.
            for t in {id(home): home, id(buf): buf}.values():
                t.set_(shared.untyped_storage(), start // t.element_size(), t.shape, t.stride())
        return path

    # ---- interface ---------------------------------------------------------------------------------------------
    def endpoint(self) -> dict[str, str]:
        if self._path is None:
            return {}
        return {"path": str(self._path), "layer_bytes": str(self._layer_bytes)}

    def add_peer(self, peer: PeerInfo) -> None:
        if self.mode != "prefill":
            self._signal_readers.open(peer)
            return
        try:
            if peer.endpoint.get("memory", "cpu") != "cpu":
                raise ValueError("the peer has GPU KV buffers and this rank CPU buffers; use tcp between them")
            path, layer_bytes = peer.endpoint["path"], int(peer.endpoint["layer_bytes"])
            fd = os.open(path, os.O_RDWR)
        except (KeyError, OSError, ValueError) as exc:
            log.warning("kv shm: cannot map the pool of %s (%s); its jobs will fail", peer.key.instance_id, exc)
            with self._lock:
                self._unmapped[peer.key] = str(exc)
            super().add_peer(peer)  # its jobs fail naming the cause
            return
        try:
            mm = mmap.mmap(fd, layer_bytes * len(self._buffers))
        finally:
            os.close(fd)
        array = np.frombuffer(mm, dtype=np.uint8)
        with self._lock:
            self._maps[peer.key] = _Mapping(mm, array, array.ctypes.data, layer_bytes, peer.layout.num_pages,
                                            peer.layout.kv_heads)
            ring = self._rings.get(peer.key)  # the same start handshaking again keeps its ring (and sequence)
        if ring is None and self._signals:
            try:
                ring = HostSignalRing(SHM_DIR, PREFIX)
            except OSError as exc:
                log.warning("kv shm: no landing signals for %s (%s); its chunks are reported after they land",
                            peer.key.instance_id, str(exc))  # not exc: its frames hold the mapping
            else:
                with self._lock:
                    self._rings[peer.key] = ring
        super().add_peer(peer)  # the worker unmaps after its last job (_peer_stopped)

    def peer_endpoint(self, key: PeerKey) -> dict[str, str]:
        with self._lock:
            ring = self._rings.get(key)
        return ring.describe() if ring is not None else {}

    def signal_reader(self, key: PeerKey) -> Callable[[int], bool] | None:
        return self._signal_readers.landed_fn(key)

    def remove_peer(self, key: PeerKey) -> None:
        super().remove_peer(key)
        self._signal_readers.remove(key)

    def close(self) -> None:
        super().close()
        self._signal_readers.close()
        with self._lock:
            rings, self._rings = list(self._rings.values()), {}
        for ring in rings:
            ring.close()
        if self._path is not None:
            self._path.unlink(missing_ok=True)

    # ---- prefill worker thread ----------------------------------------------------------------------------------
    def _move(self, job: TransferJob) -> None:
        with self._lock:
            m, why = self._maps.get(job.peer), self._unmapped.get(job.peer)
            ring = self._rings.get(job.peer) if job.signal else None
        if m is None:
            raise TransferError(f"the peer's shared pool is not mapped: {why or 'peer removed'}")
        if any(r.dst_page < 1 or r.dst_page + r.num_pages > m.num_pages for r in job.runs):
            raise TransferError(f"destination pages of room {job.room} outside the peer's {m.num_pages} pages")
        if ring is None or not job.runs:
            self._copy(job, m)
            return
        seq = ring.next()
        self.events.on_job_enqueued(job, seq)  # its ChunkDone travels while the copies below run
        landed = False
        try:
            self._copy(job, m)
            landed = True
        finally:
            ring.set(seq, landed)

    def _copy(self, job: TransferJob, m: _Mapping) -> None:
        item = self.args.item_len
        if job.heads is None:
            for i, buf in enumerate(self._buffers):
                src, dst = buf.data_ptr(), m.base + i * m.layer_bytes
                for run in job.runs:
                    ctypes.memmove(dst + run.dst_page * item, src + run.src_page * item, run.num_pages * item)
            return
        a = self.args
        shape = (m.num_pages * a.page_size, m.kv_heads, a.head_dim)
        nbytes = shape[0] * shape[1] * shape[2] * self._buffers[0].element_size()
        shared = torch.from_numpy(m.array)
        for i, buf in enumerate(self._buffers):
            dst = shared[i * m.layer_bytes:i * m.layer_bytes + nbytes].view(a.dtype).view(shape)
            copy_runs(buf, dst, job.runs, a.page_size, job.heads)

    def _peer_stopped(self, key: PeerKey) -> None:
        with self._lock:
            m = self._maps.pop(key, None)
            self._unmapped.pop(key, None)
            ring = self._rings.pop(key, None)
        if ring is not None:
            ring.close()
        if m is not None:
            del m.array
            m.mm.close()
