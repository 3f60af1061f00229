"""``shm`` on GPU buffers: same-host device-to-device copies through CUDA IPC handles.

Decode side: ``endpoint()`` exports one CUDA IPC handle per K/V buffer (torch's ``UntypedStorage._share_cuda_``,
the handle behind ``torch.multiprocessing``), with the buffer's offset in its allocation block.
Prefill side: ``add_peer`` opens the peer's handles once (``UntypedStorage._new_shared_cuda``) **under this rank's
own device**: on another GPU of the host, CUDA maps the memory with peer access, so every copy below is one
kernel on this rank's device whichever GPU holds the destination (on the same GPU it is a plain device copy).
The mappings close when the peer is removed (after its last job) or the backend closes.

Per job, on the peer's own CUDA stream (after waiting for the device's default stream, where the forward
pass that wrote the source pages was enqueued before the job was submitted):

    whole pages:  ONE kernel copies every page of every buffer straight into the peer's pool (``page_copier``,
                  built at the peer's first job: page tables of both sides, no staging, so the bytes cross memory
                  once, as a device copy's do; the page ids go up from numpy)
    head slices (heterogeneous TP):  one strided slice copy per run and buffer (``copy_runs``)

then an event is recorded, and the job's ``Landing`` synchronizes it: the workers are pipelined, so the next job's
copies are enqueued while this one's lands, and ``on_job_done`` still means the bytes are in the destination pool.
A peer in this same process (tests) cannot open its own handles (CUDA refuses); it is found by its (random)
export id in a process-local table and its tensors are used directly.

Landing signals (``landing_signal=auto`` or ``on``, not the default; ``backends/signals.py``): the prefill rank makes a
ring of interprocess events per decode peer at ``add_peer`` (exported in that peer's HelloAck), records a signalled job's event on the
peer's stream right after the job's copy and announces the job (``on_job_enqueued``) before its landing is waited
for; the decode rank opens the ring once and queries the event before it uses or confirms the chunk. Either side
that cannot set the ring up logs a warning and its chunks go today's way (ChunkDone after the landing).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from common.engine.kernels.kv_pages import page_copier
from common.kv_backends import option
from kvtransfer.args import KVArgs, KVLayout, KVTransferConfig, Mode
from kvtransfer.backends.base import BackendEvents, PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.devices import device_identity
from kvtransfer.backends.signals import CudaEventReader, CudaEventRing, PeerSignalReaders
from kvtransfer.backends.workers import Landing, QueuedBackend, TransferError
from kvtransfer.pages import copy_runs

log = logging.getLogger(__name__)

_EXPORTS: weakref.WeakValueDictionary[str, _Export] = weakref.WeakValueDictionary()  # this process's pools


class _Export:
    """A decode pool exported by this process (looked up by same-process peers)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers


@dataclass
class _PeerPool:
    """A peer's mapped pool and the copy resources of its worker thread (used by that thread only)."""

    buffers: list[torch.Tensor]  # the peer's K0, V0, K1, V1, ... on this rank's device
    num_pages: int
    kv_heads: int
    stream: torch.cuda.Stream
    default_stream: torch.cuda.Stream  # this device's, where the forward that wrote the source pages runs
    copy: Callable[[torch.Tensor], None] | None = None  # whole pages, our pool -> the peer's (page_copier)
    signals: CudaEventRing | None = None  # the peer's landing signals, recorded on ``stream``


def _hex(b: bytes | None) -> str:
    return b.hex() if b else ""


def export_handles(buffers: list[torch.Tensor]) -> str:
    """JSON list of each buffer's CUDA IPC description (what ``open_handles`` needs)."""
    out = []
    for buf in buffers:
        try:
            (_, handle, size, offset, ref, ref_offset, event, event_sync) = buf.untyped_storage()._share_cuda_()
        except RuntimeError as exc:
            raise ValueError(f"the shm backend cannot export this GPU KV pool through CUDA IPC ({exc}); "
                             "use --kv-transfer-backend tcp (staged) instead") from exc
        out.append({"handle": _hex(handle), "size": size, "offset": offset, "ref": _hex(ref),
                    "ref_offset": ref_offset, "event": _hex(event), "event_sync": bool(event_sync),
                    "storage_offset": buf.storage_offset()})
    return json.dumps(out)


def open_handles(described: str, layout: KVLayout, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The peer's buffers, mapped into this process under ``device`` (raises RuntimeError/ValueError)."""
    shape = (layout.num_pages * layout.page_size, layout.kv_heads, layout.head_dim)
    stride = (layout.kv_heads * layout.head_dim, layout.head_dim, 1)
    index = device.index if device.index is not None else torch.cuda.current_device()
    tensors = []
    for d in json.loads(described):
        storage = torch.UntypedStorage._new_shared_cuda(
            index, bytes.fromhex(d["handle"]), d["size"], d["offset"], bytes.fromhex(d["ref"]), d["ref_offset"],
            bytes.fromhex(d["event"]), d["event_sync"])
        t = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
        t.set_(storage, d["storage_offset"], shape, stride)
        tensors.append(t)
    return tensors


class CudaIpcBackend(QueuedBackend):
    transport = "shm"
    pipelined = True

    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        super().__init__(args, config, mode, events, local)
        self._device = self._buffers[0].device
        self._lock = threading.Lock()
        self._pools: dict[PeerKey, _PeerPool] = {}
        self._failed: dict[PeerKey, str] = {}
        self._export_id = uuid.uuid4().hex
        self._export: _Export | None = None
        self._handles = ""
        self._signals = option("shm", config.backend_options, "landing_signal") != "off"
        self._signal_readers = PeerSignalReaders("cuda_events", self._open_event_ring, self._signals)  # decode
        if mode == "decode":
            self._handles = export_handles(self._buffers)
            self._export = _Export(self._buffers)
            _EXPORTS[self._export_id] = self._export

    # ---- interface ---------------------------------------------------------------------------------------------
    def endpoint(self) -> dict[str, str]:
        ep = {"memory": "cuda", "export_id": self._export_id, "gpu": device_identity(self._device)}
        if self._handles:
            ep["handles"] = self._handles
        return ep

    def add_peer(self, peer: PeerInfo) -> None:
        if self.mode != "prefill":
            self._signal_readers.open(peer)
            return
        try:
            pool = self._open(peer)
        except (KeyError, ValueError, RuntimeError) as exc:
            # the worker still starts: every job to this peer then fails naming the cause (never a hang)
            log.error("kv shm: cannot open the GPU pool of %s: %s", peer.key.instance_id, exc)
            pool = None
            reason = str(exc)
        with self._lock:
            if pool is not None:
                self._pools[peer.key] = pool
            else:
                self._failed[peer.key] = reason
        super().add_peer(peer)  # the worker closes the mapping after its last job (_peer_stopped)

    def peer_endpoint(self, key: PeerKey) -> dict[str, str]:
        with self._lock:
            pool = self._pools.get(key)
        return pool.signals.describe() if pool is not None and pool.signals is not None else {}

    def signal_reader(self, key: PeerKey) -> Callable[[int], bool] | None:
        return self._signal_readers.landed_fn(key)

    def remove_peer(self, key: PeerKey) -> None:
        super().remove_peer(key)
        self._signal_readers.remove(key)

    def close(self) -> None:
        super().close()
        with self._lock:
            self._pools.clear()
            self._failed.clear()
        self._signal_readers.close()
        if self._export is not None:
            _EXPORTS.pop(self._export_id, None)
            self._export = None

    # ---- peers -------------------------------------------------------------------------------------------------
    def _open(self, peer: PeerInfo) -> _PeerPool:
        ep = peer.endpoint
        if ep.get("memory") != "cuda":
            raise ValueError(f"peer {peer.key.instance_id} has CPU KV buffers and this rank GPU buffers; "
                             "shm needs both on one kind of memory (use tcp between them)")
        layout = peer.layout
        export = _EXPORTS.get(ep.get("export_id", ""))  # ids are random: found only in the exporting process
        if export is not None:
            buffers = export.buffers
        else:
            try:
                with torch.cuda.device(self._device):
                    buffers = open_handles(ep["handles"], layout, self.args.dtype, self._device)
            except RuntimeError as exc:
                mine = device_identity(self._device)
                where = "this rank's GPU" if ep.get("gpu") == mine else f"GPU {ep.get('gpu')} from GPU {mine}"
                raise RuntimeError(f"cannot open the CUDA IPC handles of {where} ({exc}); shm needs both ranks on "
                                   "one host with peer access between their GPUs; use tcp otherwise") from exc
        if len(buffers) != len(self._buffers):
            raise ValueError(f"peer {peer.key.instance_id} exported {len(buffers)} buffers, expected "
                             f"{len(self._buffers)}")
        pool = _PeerPool(buffers, layout.num_pages, layout.kv_heads, torch.cuda.Stream(self._device),
                         torch.cuda.default_stream(self._device))
        if self._signals:
            try:
                pool.signals = CudaEventRing(self._device)
                pool.signals.describe()  # the IPC handles exist (else: no signals, not a failed peer)
            except RuntimeError as exc:
                pool.signals = None
                log.warning("kv shm: no landing signals for %s (CUDA IPC events: %s); its chunks are reported "
                            "after they land", peer.key.instance_id, str(exc))  # not exc: its frames hold the pool
        return pool

    def _open_event_ring(self, endpoint: dict[str, str]) -> CudaEventReader:
        with torch.cuda.device(self._device):
            return CudaEventReader(endpoint, self._device)

    def _peer_stopped(self, key: PeerKey) -> None:
        with self._lock:
            self._pools.pop(key, None)  # dropping the storages closes the IPC mappings
            self._failed.pop(key, None)

    # ---- prefill worker thread ----------------------------------------------------------------------------------
    def _move(self, job: TransferJob) -> Landing | None:
        """Enqueue the job's copies on the peer's stream; the host work here is the fixed cost of every job (on a
        GPU it rivals the copy itself: benchmarks/pages/kv_transfer.md), so the checks and tables are per pool."""
        with self._lock:
            pool, failed = self._pools.get(job.peer), self._failed.get(job.peer)
        if pool is None:
            raise TransferError(f"the peer's GPU pool is not mapped: {failed or 'peer removed'}")
        if not job.runs:
            return None
        ids = None
        if job.heads is None:
            ids = page_ids(job)
            dst = ids.numpy()[1]
            if dst.min() < 1 or dst.max() >= pool.num_pages:
                raise TransferError(f"destination pages of room {job.room} outside the peer's {pool.num_pages} pages")
        else:
            if any(r.dst_page < 1 or r.dst_page + r.num_pages > pool.num_pages for r in job.runs):
                raise TransferError(f"destination pages of room {job.room} outside the peer's {pool.num_pages} pages")
            if not 0 <= job.heads.dst_head <= pool.kv_heads - job.heads.num_heads:
                raise TransferError(f"destination heads of room {job.room} outside the peer's {pool.kv_heads} heads")
        with torch.cuda.stream(pool.stream):
            if ids is not None:
                device_ids = ids.to(self._device, non_blocking=True)
                pool.stream.wait_stream(pool.default_stream)
                if pool.copy is None:
                    pool.copy = page_copier(self._buffers, pool.buffers, self.args.page_size)
                pool.copy(device_ids)
            else:
                pool.stream.wait_stream(pool.default_stream)
                assert job.heads is not None
                for src, dst in zip(self._buffers, pool.buffers, strict=True):
                    copy_runs(src, dst, job.runs, self.args.page_size, job.heads)
            done = torch.cuda.Event()
            done.record(pool.stream)
            if job.signal and pool.signals is not None:
                self.events.on_job_enqueued(job, pool.signals.record(pool.stream))
        return done.synchronize


def page_ids(job: TransferJob) -> torch.Tensor:
    """int64 [2, n] on the host: the job's source pages over its destination pages, run by run."""
    runs = np.array(list(chain.from_iterable(job.runs)), dtype=np.int64).reshape(-1, 3)  # src, dst, num_pages
    counts = runs[:, 2]
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return torch.from_numpy(np.stack([np.repeat(runs[:, 0], counts) + within, np.repeat(runs[:, 1], counts) + within]))
