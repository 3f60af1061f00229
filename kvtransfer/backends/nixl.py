"""``nixl``: one-sided WRITEs through NVIDIA NIXL (UCX plugin) straight into the decode rank's pages.

Every rank runs one NIXL agent (UCX backend, progress thread on: without it a target that is not calling into
NIXL never completes a transfer) and registers its KV buffers once at start-up: DRAM for CPU buffers, VRAM for
CUDA buffers. The decode rank publishes its agent metadata (base64) and the address of each registered buffer
through ``endpoint()``; the prefill rank loads that metadata in ``add_peer`` (``add_remote_agent``) and, per job,
issues one batched WRITE (``initialize_xfer`` + ``transfer``) of all page runs of all layers, K and V. Head slices
(heterogeneous TP) go as one descriptor per token slot per buffer. A per-peer worker thread polls
``check_xfer_state`` against ``transfer_timeout_s`` and reports each job once; NIXL reports DONE only once the
bytes are in the target's memory, so no confirmation from decode is needed. CUDA buffers: ``submit`` records an
event on the device's default stream (where the forward that wrote the pages was enqueued) and the worker waits for
it before the WRITE reads the pages.

The progress thread waits on its UCX workers' event fds with a timeout of ``progress_delay_us``
(``--kv-transfer-option``, default 1000): NIXL's Python API builds every agent with a delay of 0, and its progress
thread then polls with a zero timeout, a whole core per agent even while the node is idle (one per rank, prefill and
decode). An incoming message wakes the thread through the fd at once; the timeout only bounds how long progress
may wait when nothing signals. 0 keeps NIXL's own busy polling.

Descriptors travel as plain integers, not ``get_serialized_descs`` (a pickle: loading one from the network would
run whatever it names). Transports: UCX's own selection, narrowed with ``UCX_TLS`` in the environment (cma/sm/tcp
on one host, rc/ud/dc on InfiniBand/RoCE, cuda_ipc/cuda_copy for GPU buffers).

Invariant: a job is reported only when its WRITE is finished, or cancelled (handle released), or its peer's agent
is unloaded (no endpoint left to write through): after that nothing touches its source or destination pages.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.kv_backends import int_option
from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.backends.base import BackendEvents, PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.devices import memory_kind
from kvtransfer.backends.onesided import RemotePool, pool_endpoint, write_segments
from kvtransfer.backends.workers import QueuedBackend, TransferError

try:
    import nixl._api as nixl_api
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError as exc:  # no silent fallback: the operator chose this backend
    raise ImportError(f"--kv-transfer-backend nixl needs the `nixl` package (pip install nixl): {exc}") from exc

log = logging.getLogger(__name__)

MEM_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}
SPIN_POLLS = 2000  # check_xfer_state calls before backing off to short sleeps (sleeping early halves throughput)
BACKOFF_S = 0.0002


_AGENT_CONFIG_LOCK = threading.Lock()


def _new_agent(name: str, progress_delay_us: int) -> Any:
    """A NIXL agent (UCX backend, progress thread on) whose progress thread waits ``progress_delay_us`` between
    polls. ``nixl_agent`` hard-codes ``pthrDelay = 0`` in the native config it builds, so the native config class
    is swapped, for this one construction, for a subclass that keeps the larger delay."""
    base = nixl_api.nixlBind.nixlAgentConfig
    delay_field = base.pthrDelay

    class DelayedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(delay_field.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            delay_field.__set__(self, max(int(value), progress_delay_us))

    conf = nixl_agent_config(enable_prog_thread=True, backends=["UCX"],
                             sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    with _AGENT_CONFIG_LOCK:
        nixl_api.nixlBind.nixlAgentConfig = DelayedConfig
        try:
            return nixl_agent(name, conf)
        finally:
            nixl_api.nixlBind.nixlAgentConfig = base


@dataclass
class _Remote:
    """A decode peer's agent, loaded into this (prefill) agent."""

    agent: str
    pool: RemotePool
    mem_type: str
    device_id: int
    broken: str = ""  # set when a WRITE could not be cancelled and the agent was unloaded


class NixlBackend(QueuedBackend):
    transport = "nixl"

    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        device = args.k_buffers[0].device
        if device.type not in MEM_TYPES:
            raise ValueError(f"the nixl backend moves CPU or CUDA KV buffers, not {device.type}; use tcp")
        super().__init__(args, config, mode, events, local)
        self._mem_type = MEM_TYPES[device.type]
        self._device_id = max(self._buffers[0].get_device(), 0)
        self._buffer_bytes = self._buffers[0].numel() * self._buffers[0].element_size()
        self._bases = np.array([buf.data_ptr() for buf in self._buffers], dtype=np.uint64)
        self._name = f"pdcluster-{mode}-{local.instance_id}-{local.epoch}-{uuid.uuid4().hex[:8]}"
        self._agent: Any = _new_agent(self._name, int_option("nixl", config.backend_options, "progress_delay_us"))
        if "UCX" not in self._agent.backends:
            raise RuntimeError(f"nixl: the UCX plugin did not load (plugins: {self._agent.get_plugin_list()})")
        self._reg = self._agent.register_memory(self._buffers, backends=["UCX"])
        self._lock = threading.Lock()
        self._remotes: dict[PeerKey, _Remote] = {}
        self._unloaded: dict[PeerKey, str] = {}  # peers whose agent could not be loaded: why
        self._stopping: set[PeerKey] = set()  # removed peers: their in-flight WRITE is cancelled
        self._closed = threading.Event()
        self._stuck: list[Any] = []  # handles NIXL refused to release: kept alive until the agent goes
        self._ready: weakref.WeakKeyDictionary[TransferJob, torch.cuda.Event] = weakref.WeakKeyDictionary()

    # ---- interface ---------------------------------------------------------------------------------------------
    def endpoint(self) -> dict[str, str]:
        ep = {"agent": self._name, "memory": memory_kind(self._buffers[0].device)}
        if self.mode == "decode":
            ep.update(metadata=base64.b64encode(self._agent.get_agent_metadata()).decode("ascii"),
                      mem_type=self._mem_type, device_id=str(self._device_id),
                      **pool_endpoint(self._bases, self._buffer_bytes))
        return ep

    def add_peer(self, peer: PeerInfo) -> None:
        if self.mode != "prefill":
            return  # a WRITE target needs nothing from its initiator
        try:
            ep = peer.endpoint
            pool = RemotePool.of(peer, len(self._buffers))
            name = self._agent.add_remote_agent(base64.b64decode(ep["metadata"]))
            remote = _Remote(name.decode() if isinstance(name, bytes) else str(name), pool, ep["mem_type"],
                             int(ep["device_id"]))
        except Exception as exc:  # KeyError/ValueError from a bad endpoint, nixlError from the metadata
            log.warning("kv nixl: cannot load the agent of %s (%s); its jobs will fail", peer.key.instance_id, exc)
            with self._lock:
                self._unloaded[peer.key] = f"{type(exc).__name__}: {exc}"
            super().add_peer(peer)  # its jobs fail naming the cause
            return
        with self._lock:
            self._remotes[peer.key] = remote
            self._stopping.discard(peer.key)
        super().add_peer(peer)

    def remove_peer(self, key: PeerKey) -> None:
        with self._lock:
            self._stopping.add(key)
        super().remove_peer(key)  # the worker unloads the agent after its last job (_peer_stopped)

    def submit(self, job: TransferJob) -> None:
        device = self._buffers[0].device
        if device.type == "cuda" and job.runs:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.default_stream(device))
            with self._lock:
                self._ready[job] = ready
        super().submit(job)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        super().close()
        with self._lock:
            keys = list(self._remotes)
        for key in keys:
            self._peer_stopped(key)
        if not self._stuck:
            try:
                self._agent.deregister_memory(self._reg, backends=["UCX"])
            except Exception as exc:
                log.warning("kv nixl: deregistering the KV buffers failed: %s", exc)
        # NOTE: with a stuck WRITE the registration stays until the process exits (its pages stay untouchable).

    # ---- prefill worker thread ----------------------------------------------------------------------------------
    def _descs(self, job: TransferJob, remote: _Remote) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) Nx3 uint64 descriptor arrays (address, length, device id), buffer-major."""
        src, dst, length = write_segments(self.args, self._bases, self._buffers[0].element_size(), remote.pool, job)
        local, dest = np.empty((len(src), 3), dtype=np.uint64), np.empty((len(src), 3), dtype=np.uint64)
        local[:, 0], dest[:, 0] = src, dst
        local[:, 1] = dest[:, 1] = length
        local[:, 2], dest[:, 2] = self._device_id, remote.device_id
        return local, dest

    def _move(self, job: TransferJob) -> None:
        with self._lock:
            remote, why = self._remotes.get(job.peer), self._unloaded.get(job.peer)
        if remote is None:
            raise TransferError(f"the peer's NIXL agent is not loaded: {why or 'peer removed'}")
        if remote.broken:
            raise TransferError(remote.broken)
        if not job.runs:
            return
        local, dest = self._descs(job, remote)
        with self._lock:
            ready = self._ready.pop(job, None)
        if ready is not None:
            ready.synchronize()  # the forward that wrote these pages has finished
        agent = self._agent
        try:
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, self._mem_type),
                                           agent.get_xfer_descs(dest, remote.mem_type), remote.agent)
        except Exception as exc:  # nixlNotFoundError: the descriptors fall outside the registered memory
            raise TransferError(f"NIXL refused the WRITE of room {job.room}: {type(exc).__name__}: {exc}") from exc
        try:
            state = agent.transfer(handle)
            self._wait(job, remote, handle, state)
        finally:
            self._release(job, remote, handle)

    def _wait(self, job: TransferJob, remote: _Remote, handle: Any, state: str) -> None:
        deadline = time.monotonic() + self.config.transfer_timeout_s
        polls = 0
        while state == "PROC":
            with self._lock:
                stopping = job.peer in self._stopping
            if stopping or self._closed.is_set():
                raise TransferError(f"WRITE of room {job.room} cancelled: peer removed or backend closed")
            if time.monotonic() > deadline:
                raise TransferError(f"WRITE of room {job.room} not done within {self.config.transfer_timeout_s}s")
            polls += 1
            time.sleep(0 if polls < SPIN_POLLS else BACKOFF_S)
            state = self._agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferError(f"WRITE of room {job.room} failed in NIXL (state {state})")

    def _release(self, job: TransferJob, remote: _Remote, handle: Any) -> None:
        """Free the request; one that cannot be cancelled makes the peer unusable (its agent is unloaded)."""
        try:
            self._agent.release_xfer_handle(handle)
            return
        except Exception as exc:
            log.error("kv nixl: WRITE of room %d to %s could not be cancelled (%s); unloading its agent",
                      job.room, job.peer.instance_id, exc)
            self._stuck.append(handle)
        remote.broken = f"an earlier WRITE to {job.peer.instance_id} could not be cancelled"
        try:
            self._agent.remove_remote_agent(remote.agent)
        except Exception as exc:
            log.error("kv nixl: unloading the agent of %s failed: %s", job.peer.instance_id, exc)

    def _peer_stopped(self, key: PeerKey) -> None:
        with self._lock:
            remote = self._remotes.pop(key, None)
            self._unloaded.pop(key, None)
            self._stopping.discard(key)
        if remote is not None and not remote.broken:
            try:
                self._agent.remove_remote_agent(remote.agent)
            except Exception as exc:
                log.warning("kv nixl: unloading the agent of %s failed: %s", key.instance_id, exc)
