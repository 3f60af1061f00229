"""``nccl``: KV pages over torch.distributed point-to-point, one standalone 2-rank process group per
(prefill rank, decode rank) pair: ``ProcessGroupNCCL`` for CUDA buffers, ``ProcessGroupGloo`` for CPU buffers (the
same code path; CPU CI runs it on gloo). The global default group is never touched.

Rendezvous (per pair, when the pair is made: ``add_peer`` starts one thread per peer on each side)::

    decode: a TCPStore server per backend, address in endpoint() {"store", "pair_id"}
    prefill, pair thread:  store.set(<pfx>/start)         decode, pair thread:  poll store.check(<pfx>/start)
    ProcessGroup*(PrefixStore(<pfx>), rank 0, 2)   <--->   ProcessGroup*(PrefixStore(<pfx>), rank 1, 2)
    (the prefill's job worker waits for its pair's group while watching for removal, so a peer that dies during
    the rendezvous fails its jobs at remove_peer, not after the rendezvous timeout)
    <pfx> = "kv/<prefill pair_id>/<decode pair_id>/<pairing>"   (pair ids are fresh per backend start, the
                      pairing per handshake: neither a restart nor a peer that handshakes again after a stall meets
                      a stale group)

Per job, in a peer's submission order (one job at a time per pair; within one tag gloo matches in posting order)::

    P -> D  TAG_CTL   int64[1] length, uint8[length] ChunkHeader        (see ``_twosided``)
    P -> D  TAG_DATA  payload messages (``_twosided``): by default one per run, layer and K/V, pool to pool
    D -> P  TAG_ACK   int64[1] length, uint8[length] ChunkAck           once every receive landed

Devices: a CUDA pair is two ranks on distinct GPUs (NCCL cannot pair two ranks on one GPU): each side's
``endpoint()`` names its GPU (UUID), and a peer on this rank's own GPU is refused at ``add_peer``; its jobs fail
with an error naming ``shm``/``tcp``. Every thread that drives NCCL sets this rank's device first.

Failure: any error or a wait over ``transfer_timeout_s`` breaks the pair (gloo closes a pair whose wait timed out,
which also wakes a thread blocked on it; NCCL is aborted) and every later job to that peer fails naming it. A dead
peer's sockets close, so blocked waits raise at once.

Settings (``--kv-transfer-option``): ``pack_bytes`` (default 0: one zero-copy message per run and
layer; see ``_twosided`` for packing small runs into staging messages).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common.kv_backends import int_option
from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.backends import _twosided as twosided
from kvtransfer.backends import wire
from kvtransfer.backends.base import BackendEvents, PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.devices import device_identity, memory_kind
from kvtransfer.backends.workers import QueuedBackend, TransferError

log = logging.getLogger(__name__)

TAG_CTL, TAG_DATA, TAG_ACK, TAG_BREAK = 1, 2, 3, 0x7FFF
PREFILL_RANK, DECODE_RANK = 0, 1
IDLE_WAIT = datetime.timedelta(days=30)  # a decode pair waits this long for the next header (idle is normal)
START_POLL_S = 0.2  # decode threads notice close() within this
STAGING_WINDOW = 64 << 20  # per job and side: staged payload bytes in flight (see _twosided's packing)
MAX_CONTROL_BYTES = 64 << 20  # a header of ~5M runs; anything larger means the stream is corrupt


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@dataclass
class _Pair:
    """One peer's process group. ``broken`` is sticky: once set, nothing is sent or received on ``pg`` again."""

    key: PeerKey
    info: PeerInfo
    prefix: str
    pg: dist.ProcessGroup | None = None
    broken: str | None = None
    thread: threading.Thread | None = None  # rendezvous (prefill) / rendezvous + receive (decode)
    ready: threading.Event = field(default_factory=threading.Event)  # set once pg or broken is
    lock: threading.Lock = field(default_factory=threading.Lock)


class NcclBackend(QueuedBackend):
    transport = "nccl"

    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        super().__init__(args, config, mode, events, local)
        self._device = args.k_buffers[0].device
        self._gpu = device_identity(self._device)
        self._pair_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._closed = False
        self._pairs: dict[PeerKey, _Pair] = {}
        self._threads: list[threading.Thread] = []  # every pair thread not yet known to have ended
        self._gloo_device: object | None = None
        self._connect_s = min(config.bootstrap_timeout_s, 30.0)
        # default 0 (common.kv_backends): per-run messages; packing's two copies are slower on gloo (kv_transfer page)
        self._pack_bytes = int_option("nccl", config.backend_options, "pack_bytes")
        self._store: dist.TCPStore | None = None
        if mode == "decode":
            self._store = dist.TCPStore(config.host, 0, is_master=True, wait_for_workers=False,
                                        timeout=_td(self._connect_s))

    # ---- interface ---------------------------------------------------------------------------------------------
    def endpoint(self) -> dict[str, str]:
        """Decode: its store address; both: the pair id that names this start in group prefixes."""
        ep = {"pair_id": self._pair_id, "memory": memory_kind(self._device), "gpu": self._gpu}
        if self._store is not None:
            ep["store"] = f"{self.config.advertised_host}:{self._store.port}"
        return ep

    def add_peer(self, peer: PeerInfo) -> None:
        """Start the peer's rendezvous thread (decode: it then serves the peer's jobs) and, on prefill, its job
        worker."""
        if "pair_id" not in peer.endpoint:
            raise ValueError(f"peer {peer.key.instance_id} has no nccl endpoint: {peer.endpoint}")
        p_id, d_id = (self._pair_id, peer.endpoint["pair_id"]) if self.mode == "prefill" else \
            (peer.endpoint["pair_id"], self._pair_id)
        # NOTE: a peer that handshakes again (after a stall) pairs anew under a new name: a group rendezvous under
        # the old prefix would read the old group's keys from the store.
        pair = _Pair(peer.key, peer, f"kv/{p_id}/{d_id}/{peer.pairing}" if peer.pairing else f"kv/{p_id}/{d_id}")
        refused = self._unpairable(peer)
        if refused:
            log.error("kv nccl: %s", refused)
            pair.broken = refused  # its jobs fail with this reason; no rendezvous is attempted
            pair.ready.set()
        else:
            target = self._connect if self.mode == "prefill" else self._serve
            pair.thread = threading.Thread(target=target, args=(pair,), daemon=True,
                                           name=f"kv-nccl-{self.mode}-{peer.key.instance_id[-12:]}")
        with self._lock:
            if self._closed or peer.key in self._pairs:
                return
            self._pairs[peer.key] = pair
            self._threads = [t for t in self._threads if t.is_alive()]
            if pair.thread is not None:
                self._threads.append(pair.thread)
        if pair.thread is not None:
            pair.thread.start()
        super().add_peer(peer)

    def _unpairable(self, peer: PeerInfo) -> str:
        """Why this rank and ``peer`` cannot form an NCCL/gloo pair ("" if they can)."""
        theirs = peer.endpoint.get("memory", memory_kind(self._device))
        if theirs != memory_kind(self._device):
            return (f"nccl cannot pair {self.mode} {memory_kind(self._device)} KV buffers with peer "
                    f"{peer.key.instance_id}'s {theirs} buffers (NCCL moves GPU memory, gloo host memory); "
                    "use --kv-transfer-backend tcp")
        if self._gpu and peer.endpoint.get("gpu") == self._gpu:
            return (f"nccl cannot pair two ranks on one GPU: this {self.mode} rank and peer "
                    f"{peer.key.instance_id} are both on {self._gpu}; use --kv-transfer-backend shm (CUDA IPC, "
                    "same host) or tcp, or put the nodes on distinct GPUs (--base-gpu-id)")
        return ""

    def _set_device(self) -> None:
        """NCCL calls use the calling thread's current device: make it this rank's."""
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    def remove_peer(self, key: PeerKey) -> None:
        with self._lock:
            pair = self._pairs.pop(key, None)
        super().remove_peer(key)
        if pair is not None:
            self._break(pair, "peer removed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs, threads = list(self._pairs.values()), list(self._threads)
            self._pairs.clear()
        for pair in pairs:
            self._break(pair, "backend closed")
        super().close()
        for thread in threads:  # bounded: a thread still in a rendezvous ends within _connect_s
            thread.join(self._connect_s + 1)
        self._store = None

    # ---- groups ------------------------------------------------------------------------------------------------
    def _new_group(self, store: dist.Store, prefix: str, rank: int) -> dist.ProcessGroup:
        """A standalone 2-rank group under ``prefix`` (blocks until the peer joins or ``_connect_s`` passes)."""
        pstore = dist.PrefixStore(prefix, store)
        if self._device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _td(self._connect_s)
            return dist.ProcessGroupNCCL(pstore, rank, 2, opts)
        with self._lock:
            if self._gloo_device is None:  # one listening device per backend, shared by its groups
                self._gloo_device = dist.ProcessGroupGloo.create_device(hostname=self.config.advertised_host)
            device = self._gloo_device
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [device]
        opts._timeout = _td(self._connect_s)  # rendezvous; every later wait passes its own timeout
        opts._threads = 1  # point-to-point needs no collective worker threads
        return dist.ProcessGroupGloo(pstore, rank, 2, opts)

    def _break(self, pair: _Pair, reason: str) -> None:
        """Mark the pair broken and wake whoever waits on it; the peer's waits fail as its sockets close."""
        with pair.lock:
            if pair.broken is None:
                pair.broken = reason
            pg = pair.pg
        pair.ready.set()
        if pg is None:
            return
        if self._device.type == "cuda":
            pg.abort()
            return
        # NOTE: gloo cannot cancel a posted receive and ProcessGroup.abort() does not wake its waiter; a wait that
        # times out closes the pair, which fails every pending operation on it (the blocked waiter included).
        sentinel = torch.empty(1, dtype=torch.uint8)
        peer = DECODE_RANK if self.mode == "prefill" else PREFILL_RANK
        with contextlib.suppress(RuntimeError):  # the timeout is the point
            pg.recv([sentinel], peer, TAG_BREAK).wait(datetime.timedelta(milliseconds=1))

    # ---- messages ----------------------------------------------------------------------------------------------
    def _wait(self, work: dist.Work, timeout: datetime.timedelta) -> None:
        work.wait(timeout)
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def _send_msg(self, pg: dist.ProcessGroup, peer: int, tag: int, msg: wire.AnyDataMessage) -> list[dist.Work]:
        body = torch.frombuffer(bytearray(wire.encode(msg)), dtype=torch.uint8).to(self._device)
        size = torch.tensor([body.numel()], dtype=torch.int64, device=self._device)
        return [pg.send([size], peer, tag), pg.send([body], peer, tag)]

    def _recv_msg(self, pg: dist.ProcessGroup, peer: int, tag: int,
                  timeout: datetime.timedelta) -> wire.AnyDataMessage:
        size = torch.empty(1, dtype=torch.int64, device=self._device)
        self._wait(pg.recv([size], peer, tag), timeout)
        if not 0 < int(size.item()) <= MAX_CONTROL_BYTES:
            raise TransferError(f"control message of {int(size.item())} bytes (stream out of step?)")
        body = torch.empty(int(size.item()), dtype=torch.uint8, device=self._device)
        self._wait(pg.recv([body], peer, tag), timeout)
        return wire.decode(body.cpu().numpy().tobytes())

    # ---- prefill: the peer's worker thread runs one job at a time -----------------------------------------------
    def _connect(self, pair: _Pair) -> None:
        """Pair thread: tell the decode side to join, then build the group (bounded by ``_connect_s``)."""
        host, _, port = pair.info.endpoint.get("store", "").rpartition(":")
        self._set_device()
        try:
            if not host:
                raise ValueError(f"no nccl store address in {pair.info.endpoint}")
            store = dist.TCPStore(host, int(port), is_master=False, timeout=_td(self._connect_s))
            store.set(f"{pair.prefix}/start", self._pair_id)
            pg = self._new_group(store, pair.prefix, PREFILL_RANK)
        except (RuntimeError, ValueError) as exc:
            self._break(pair, f"rendezvous with {pair.info.endpoint.get('store')} failed: {exc}")
            return
        with pair.lock:
            pair.pg = pg
            broken = pair.broken
        pair.ready.set()
        if broken is not None:  # removed while connecting
            self._break(pair, broken)

    def _ready_pair(self, key: PeerKey) -> _Pair:
        """Job worker: the peer's pair once its group exists; raises if it was removed or broke first."""
        with self._lock:
            pair = self._pairs.get(key)
        while pair is not None and not pair.ready.wait(START_POLL_S):
            with self._lock:
                pair = self._pairs.get(key)
        if pair is None:
            raise TransferError("peer removed")
        if pair.broken is not None:
            raise TransferError(f"connection broken: {pair.broken}")
        return pair

    def _move(self, job: TransferJob) -> None:
        pair = self._ready_pair(job.peer)
        assert pair.pg is not None
        self._set_device()
        pg, timeout = pair.pg, _td(self.config.transfer_timeout_s)
        try:
            header, msgs = twosided.source_messages(self.args, job, self._pack_bytes)
            sent: deque[tuple[dist.Work, torch.Tensor, int]] = deque()  # send, its tensor (kept alive), staged
            sent.extend((w, torch.empty(0), 0) for w in self._send_msg(pg, DECODE_RANK, TAG_CTL, header))
            staged = 0
            for msg in msgs:
                tensor = msg.gather()
                nbytes = 0 if msg.direct else msg.nbytes
                sent.append((pg.send([wire.as_bytes(tensor)], DECODE_RANK, TAG_DATA), tensor, nbytes))
                staged += nbytes
                while staged > STAGING_WINDOW:  # bounds staging memory; sends complete in order
                    work, _, done = sent.popleft()
                    self._wait(work, timeout)
                    staged -= done
            ack = self._recv_msg(pg, DECODE_RANK, TAG_ACK, timeout)
            if isinstance(ack, wire.ChunkAck) and not ack.error:
                for work, _, _ in sent:
                    self._wait(work, timeout)
        except Exception as exc:  # any failure of the group is this job's (reported, never swallowed)
            reason = pair.broken or f"room {job.room} chunk {job.chunk_id}: {type(exc).__name__}: {exc}"
            self._break(pair, reason)
            raise TransferError(reason) from exc
        # NOTE: a refusal or a stray reply leaves payload unread on the wire: the pair cannot be reused.
        if not isinstance(ack, wire.ChunkAck) or (ack.room, ack.chunk_id) != (job.room, job.chunk_id):
            reason = f"unexpected reply {ack!r} to room {job.room} chunk {job.chunk_id}"
        elif ack.error:
            reason = f"decode refused room {job.room} chunk {job.chunk_id}: {ack.error}"
        else:
            return
        self._break(pair, reason)
        raise TransferError(reason)

    # ---- decode: one thread per prefill peer -------------------------------------------------------------------
    def _serve(self, pair: _Pair) -> None:
        self._set_device()
        try:
            pg = self._join(pair)
            if pg is None:
                return
            while pair.broken is None:
                header = self._recv_msg(pg, PREFILL_RANK, TAG_CTL, IDLE_WAIT)
                if not isinstance(header, wire.ChunkHeader):
                    raise TransferError(f"expected ChunkHeader, got {type(header).__name__}")
                self._receive(pg, header)
        except Exception as exc:  # the connection ends; the prefill side fails its jobs (logged, not swallowed)
            if pair.broken is None:
                log.info("kv nccl: connection from %s ended: %s: %s", pair.key.instance_id, type(exc).__name__, exc)
            self._break(pair, str(exc))

    def _join(self, pair: _Pair) -> dist.ProcessGroup | None:
        """Wait for the prefill's start signal (polling, so close() is prompt), then join the group."""
        assert self._store is not None
        store, start = self._store, f"{pair.prefix}/start"
        while not store.check([start]):
            if pair.broken is not None:
                return None
            time.sleep(START_POLL_S)
        pg = self._new_group(store, pair.prefix, DECODE_RANK)
        with pair.lock:
            pair.pg = pg
            broken = pair.broken
        if broken is not None:
            self._break(pair, broken)
            return None
        return pg

    def _receive(self, pg: dist.ProcessGroup, header: wire.ChunkHeader) -> None:
        """Land one job's payload in the pool, then ack. A refused header is acked with the reason and the
        connection dropped (its payload is never read, so nothing of it is written)."""
        timeout = _td(self.config.transfer_timeout_s)
        try:
            msgs = twosided.destination_messages(self.args, header)
        except twosided.RefusedHeader as exc:
            for work in self._send_msg(pg, PREFILL_RANK, TAG_ACK, wire.ChunkAck(header.room, header.chunk_id,
                                                                               str(exc))):
                self._wait(work, timeout)
            raise TransferError(f"refused room {header.room} chunk {header.chunk_id}: {exc}") from exc
        posted: deque[tuple[dist.Work, twosided.Message, torch.Tensor]] = deque()
        staged = 0
        for msg in msgs:
            landing = msg.landing()
            posted.append((pg.recv([wire.as_bytes(landing)], PREFILL_RANK, TAG_DATA), msg, landing))
            staged += 0 if msg.direct else msg.nbytes
            while posted and (staged > STAGING_WINDOW or msg is msgs[-1]):  # receives complete in order
                work, done, landed = posted.popleft()
                self._wait(work, timeout)
                done.scatter(landed)
                staged -= 0 if done.direct else done.nbytes
        for work in self._send_msg(pg, PREFILL_RANK, TAG_ACK, wire.ChunkAck(header.room, header.chunk_id)):
            self._wait(work, timeout)
