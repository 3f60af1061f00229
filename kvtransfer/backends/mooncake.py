"""``mooncake``: one-sided WRITEs through the Mooncake Transfer Engine straight into the decode rank's pages.

Every rank runs one ``TransferEngine`` in P2P-handshake mode (no metadata server: a peer's segment is fetched from
its engine's RPC port on first use) and registers its KV buffers once at start-up. The decode rank publishes its
session (``host:rpc_port``) and the address of each registered buffer through ``endpoint()``; the prefill rank
issues, per job, batched WRITEs (``batch_transfer_sync_write``, at most ``MAX_BATCH`` segments each) of every page
run of every layer, K and V (head slices: one segment per token slot per buffer, see ``onesided``). The engine returns once every segment is in
the target's memory, or failed, or its own deadline passed (``MC_TRANSFER_TIMEOUT``, set here from
``transfer_timeout_s`` unless the operator set it, plus one second per GiB), so no confirmation from decode is
needed and every wait is bounded. The target engine refuses a segment outside its registered buffers.

Transport: ``--kv-transfer-option mooncake_protocol=...``, default "tcp" (any host); "rdma" on InfiniBand/RoCE with
``mooncake_device`` naming the NICs. Wheel: ``mooncake-transfer-engine-non-cuda`` (extra ``mooncake``; the CUDA
wheel links the CUDA 12 driver and runtime), which needs Debian's ``libibverbs1``. KV buffers: host memory only
(GPU memory needs the CUDA wheel and GPUDirect RDMA, not exercised here: refused at start-up).

Invariant: a job is reported only after its WRITE call returned, so nothing of it touches source or destination
pages afterwards; the registration is dropped at close only when no WRITE is still running.
Trust: the engine's data port accepts WRITEs into the registered pool from any host that reaches it (as NIXL's
UCX endpoints do); only peers that passed the control-plane handshake (cluster token) learn its session.
"""

from __future__ import annotations

import logging
import math
import os
import threading

import numpy as np

from common.kv_backends import option
from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.backends.base import BackendEvents, PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.devices import memory_kind
from kvtransfer.backends.onesided import RemotePool, pool_endpoint, write_segments
from kvtransfer.backends.workers import QueuedBackend, TransferError

os.environ.setdefault("GLOG_minloglevel", "1")  # the engine logs every connection at INFO on stderr
try:
    from mooncake.engine import TransferEngine
except ImportError as exc:  # no silent fallback: the operator chose this backend
    raise ImportError(
        "--kv-transfer-backend mooncake needs the Mooncake Transfer Engine: pip install "
        "mooncake-transfer-engine-non-cuda (or `make install`), and Debian's libibverbs1 (apt-get install "
        f"libibverbs1), which it links: {exc}") from exc

log = logging.getLogger(__name__)

MIN_ENGINE_TIMEOUT_S = 5  # the engine's own floor for MC_TRANSFER_TIMEOUT
MAX_BATCH = 2048  # segments per batch_transfer_sync_write: 0.3.13 fails (-1) any batch of more (measured: 2049)


class MooncakeBackend(QueuedBackend):
    transport = "mooncake"

    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        device = args.k_buffers[0].device
        if device.type != "cpu":
            raise ValueError(f"the mooncake backend moves host KV buffers here, not {device.type}; use nixl or shm "
                             "for GPU buffers")
        super().__init__(args, config, mode, events, local)
        opts = config.backend_options
        # NOTE: read once per engine at construction; the process's first value holds for all its engines.
        os.environ.setdefault("MC_TRANSFER_TIMEOUT",
                              str(max(MIN_ENGINE_TIMEOUT_S, math.ceil(config.transfer_timeout_s))))
        self._engine = TransferEngine()
        protocol = option("mooncake", opts, "mooncake_protocol")
        if self._engine.initialize(config.advertised_host, "P2PHANDSHAKE", protocol,
                                   option("mooncake", opts, "mooncake_device")) != 0:
            raise RuntimeError(f"mooncake: the transfer engine did not start on {config.advertised_host} over "
                               f"{protocol!r} (see its log above)")
        self._bases = np.array([buf.data_ptr() for buf in self._buffers], dtype=np.uint64)
        self._buffer_bytes = self._buffers[0].numel() * self._buffers[0].element_size()
        if self._engine.batch_register_memory([int(b) for b in self._bases],
                                              [self._buffer_bytes] * len(self._buffers)) != 0:
            raise RuntimeError("mooncake: registering the KV buffers with the transfer engine failed")
        self._lock = threading.Lock()
        self._targets: dict[PeerKey, tuple[str, RemotePool]] = {}  # prefill: session and pool per decode peer
        self._unusable: dict[PeerKey, str] = {}  # peers whose endpoint could not be read: why
        self._writing = 0  # WRITE calls in progress (the registration stays while any is)
        self._closed = False

    # ---- interface ---------------------------------------------------------------------------------------------
    def endpoint(self) -> dict[str, str]:
        ep = {"memory": memory_kind(self._buffers[0].device)}
        if self.mode == "decode":
            ep.update(session=f"{self.config.advertised_host}:{self._engine.get_rpc_port()}",
                      **pool_endpoint(self._bases, self._buffer_bytes))
        return ep

    def add_peer(self, peer: PeerInfo) -> None:
        if self.mode != "prefill":
            return  # a WRITE target needs nothing from its initiator
        try:
            if peer.endpoint.get("memory", "cpu") != "cpu":
                raise ValueError("the peer has GPU KV buffers; the mooncake backend moves host buffers here")
            target = (peer.endpoint["session"], RemotePool.of(peer, len(self._buffers)))
        except (KeyError, ValueError) as exc:
            log.warning("kv mooncake: unusable endpoint of %s (%s); its jobs will fail", peer.key.instance_id, exc)
            with self._lock:
                self._unusable[peer.key] = f"{type(exc).__name__}: {exc}"
        else:
            with self._lock:
                self._targets[peer.key] = target
        super().add_peer(peer)

    def remove_peer(self, key: PeerKey) -> None:
        with self._lock:  # its queued jobs fail at once; a WRITE in progress ends (bounded) and then fails too
            self._targets.pop(key, None)
            self._unusable.pop(key, None)
        super().remove_peer(key)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        super().close()
        with self._lock:
            writing = self._writing
        if writing:  # NOTE: its pages stay registered (untouchable) until the process exits
            log.warning("kv mooncake: %d WRITE(s) still running at close; the KV buffers stay registered", writing)
            return
        if self._engine.batch_unregister_memory([int(b) for b in self._bases]) != 0:
            log.warning("kv mooncake: deregistering the KV buffers failed")

    # ---- prefill worker thread ----------------------------------------------------------------------------------
    def _move(self, job: TransferJob) -> None:
        with self._lock:
            target, why = self._targets.get(job.peer), self._unusable.get(job.peer)
            if target is None:
                raise TransferError(f"the peer's Mooncake segment is unknown: {why or 'peer removed'}")
            if self._closed:
                raise TransferError("backend closed")
            self._writing += 1
        session, pool = target
        try:
            if not job.runs:
                return
            src, dst, length = write_segments(self.args, self._bases, self._buffers[0].element_size(), pool, job)
            ret = 0
            for i in range(0, len(src), MAX_BATCH):  # NOTE: in order; the first failed batch ends the job
                ret = self._engine.batch_transfer_sync_write(session, src[i:i + MAX_BATCH].tolist(),
                                                             dst[i:i + MAX_BATCH].tolist(),
                                                             length[i:i + MAX_BATCH].tolist())
                if ret != 0:
                    break
        finally:
            with self._lock:
                self._writing -= 1
                removed = job.peer not in self._targets
        if removed:
            raise TransferError(f"room {job.room} chunk {job.chunk_id}: peer removed during its WRITE")
        if ret != 0:
            raise TransferError(f"Mooncake WRITE of room {job.room} chunk {job.chunk_id} to {session} failed ({ret}): "
                                "peer unreachable, pages outside its registered pool, or past "
                                f"MC_TRANSFER_TIMEOUT={os.environ.get('MC_TRANSFER_TIMEOUT')}s")
