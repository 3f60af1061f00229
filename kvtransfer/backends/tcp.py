"""``tcp``: KV pages over plain TCP sockets, scatter/gather with ``sendmsg``/``recvmsg_into`` straight from the
source pages into the destination pages (no staging copy for whole pages). Works everywhere.

GPU buffers (either side) travel staged through pinned host buffers, overlapped per segment (``staging``): the
header's ``segment_pages`` > 0 says the payload is in the staged layout. Settings
(``KVTransferConfig.backend_options``): ``stage`` ("auto": stage when either side's buffers are on a GPU;
"always": stage CPU buffers too, the same byte path CI runs), ``stage_bytes`` (segment size, default 16 MiB).

One connection per (prefill rank, decode peer), opened lazily by the prefill side's per-peer worker. Stream::

    decode -> prefill   nonce (16 bytes)                                  once per connection: the challenge
    prefill -> decode   frame(DataHello)                                  its proof of the cluster secret
    prefill -> decode   frame(ChunkHeader) payload                        per job
    decode -> prefill   frame(ChunkAck)                                   per job, after the payload landed
    frame = u32 little-endian length + msgpack (``wire``);  payload = for layer: for K, V: for run: the run's bytes
                                                 (staged: for segment: see ``staging``)

The ack is what makes ``on_job_done(job, None)`` mean "in the destination pages" (see ``base.py``).

Listener bounds: nothing is allocated for a connection before its DataHello proves the secret for an accepted peer
(the hello frame is capped at ``MAX_HELLO_BYTES`` and must arrive within ``HELLO_TIMEOUT_S``); a frame never exceeds
``max_frame_bytes`` and a payload never exceeds what its header's destination runs hold; at most
``MAX_CONNS_PER_HOST`` connections per remote host and ``MAX_CONNS`` in all (one reader thread each).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import select
import socket
import struct
import threading

import msgspec
import torch

from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.backends.base import BackendEvents, PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.staging import DEFAULT_SEGMENT_BYTES, PageStager, expand_pages
from kvtransfer.backends.wire import (
    AnyDataMessage,
    ChunkAck,
    ChunkHeader,
    DataHello,
    data_proof,
    decode,
    encode,
)
from kvtransfer.backends.workers import QueuedBackend, TransferError
from kvtransfer.pages import HeadSlice, PageRun

log = logging.getLogger(__name__)

IOV_BATCH = 64
_LEN = struct.Struct("<I")
NONCE_BYTES = 16
MAX_HELLO_BYTES = 1024
HELLO_TIMEOUT_S = 5.0
MAX_CONNS_PER_HOST = 8
MAX_CONNS = 64
DISCARD_BYTES = 1 << 16


def _send_frame(sock: socket.socket, msg: AnyDataMessage) -> None:
    body = encode(msg)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_views(sock, [memoryview(buf)])
    return bytes(buf)


def _recv_frame(sock: socket.socket, max_bytes: int = 1 << 20) -> AnyDataMessage:
    """One frame; a declared length over ``max_bytes`` closes the connection before anything is allocated."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > max_bytes:
        raise TransferError(f"frame of {n} bytes exceeds the limit of {max_bytes}")
    return decode(_recv_exact(sock, n))


def _send_views(sock: socket.socket, views: list[memoryview]) -> None:
    i, off = 0, 0
    while i < len(views):
        batch = views[i:i + IOV_BATCH]
        if off:
            batch[0] = batch[0][off:]
        sent = sock.sendmsg(batch)
        while sent and i < len(views):
            rest = len(views[i]) - off
            if sent >= rest:
                sent, i, off = sent - rest, i + 1, 0
            else:
                off, sent = off + sent, 0
        while i < len(views) and len(views[i]) == 0:
            i += 1


def _recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill ``views`` from the stream. MSG_WAITALL: the kernel returns once the whole batch (up to IOV_BATCH views)
    is in, not whenever a segment lands, so a 512 MiB payload takes ~64 calls instead of ~1,400, and the Python
    between calls (and its GIL hand-offs to the process's other threads) stops paying per segment. A short return
    (a signal, the peer closing, a shutdown from another thread) is accounted for like any other."""
    i, off = 0, 0
    while i < len(views) and len(views[i]) == 0:
        i += 1
    while i < len(views):
        batch = views[i:i + IOV_BATCH]
        if off:
            batch[0] = batch[0][off:]
        got = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("connection closed by peer")
        while got and i < len(views):
            rest = len(views[i]) - off
            if got >= rest:
                got, i, off = got - rest, i + 1, 0
            else:
                off, got = off + got, 0
        while i < len(views) and len(views[i]) == 0:
            i += 1


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class TcpBackend(QueuedBackend):
    transport = "tcp"

    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        super().__init__(args, config, mode, events, local)
        self._on_device = self._buffers[0].device.type != "cpu"
        # layer-major: K0, V0, K1, V1, ... (host buffers only: device buffers always travel staged)
        self._views = [] if self._on_device else [_bytes_of(buf) for buf in self._buffers]
        stage = config.backend_options.get("stage", "auto")
        if stage not in ("auto", "always"):
            raise ValueError(f"tcp backend option stage must be 'auto' or 'always', got {stage!r}")
        self._stage_always = stage == "always"
        self._segment_bytes = int(config.backend_options.get("stage_bytes", DEFAULT_SEGMENT_BYTES))
        if self._segment_bytes <= 0:
            raise ValueError(f"tcp backend option stage_bytes must be > 0, got {self._segment_bytes}")
        self._stagers: dict[PeerKey, PageStager] = {}  # prefill: per peer (used by that peer's worker only)
        self._recv_stager = threading.local()  # decode: one per connection thread
        self._lock = threading.Lock()
        self._closed = False
        self._peers: dict[PeerKey, PeerInfo] = {}
        self._socks: dict[PeerKey, socket.socket] = {}  # prefill: connection per decode peer
        self._accepted: dict[socket.socket, PeerKey | None] = {}  # decode: connections by sending peer
        self._conns_by_host: dict[str, int] = {}  # decode: open connections (proven or not) per remote host
        # A header lists at most one run per page; msgpack needs < 32 bytes per run.
        self.max_frame_bytes = 4096 + 32 * args.num_pages
        self.refused_connections = 0
        self._listener: socket.socket | None = None
        if mode == "decode":
            self._listener = socket.create_server((config.host, 0))
            threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True).start()

    # ---- interface ---------------------------------------------------------------------------------------------
    def endpoint(self) -> dict[str, str]:
        if self._listener is None:
            return {}
        port = self._listener.getsockname()[1]
        return {"host": self.config.advertised_host, "port": str(port), "device": self._buffers[0].device.type}

    def add_peer(self, peer: PeerInfo) -> None:
        with self._lock:
            self._peers[peer.key] = peer
        super().add_peer(peer)

    def remove_peer(self, key: PeerKey) -> None:
        with self._lock:
            self._peers.pop(key, None)
            self._stagers.pop(key, None)
            socks = [self._socks.pop(key)] if key in self._socks else []
            socks += [s for s, k in self._accepted.items() if k == key]
        super().remove_peer(key)
        for sock in socks:
            _shutdown(sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [*self._socks.values(), *self._accepted]
            self._socks.clear()
        for sock in socks:
            _shutdown(sock)
        if self._listener is not None:
            _shutdown(self._listener)
        super().close()

    # ---- prefill: one worker thread per peer --------------------------------------------------------------------
    def _move(self, job: TransferJob) -> None:
        sock = self._connection(job.peer)
        try:
            self._move_on(sock, job)
        except (OSError, ConnectionError, msgspec.DecodeError, TransferError) as exc:
            # The stream is in an unknown state (half a payload, a stale ack, a peer that closed it): drop the
            # connection so the peer's next job opens a fresh one instead of failing on a dead socket forever.
            with self._lock:
                if self._socks.get(job.peer) is sock:
                    del self._socks[job.peer]
            _shutdown(sock)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"connection to {job.peer.instance_id} lost ({exc}); reconnecting") from exc

    def _move_on(self, sock: socket.socket, job: TransferJob) -> None:
        heads = None if job.heads is None else (job.heads.src_head, job.heads.dst_head, job.heads.num_heads)
        dst_runs = [(r.dst_page, r.num_pages) for r in job.runs]
        stager = self._stager(job.peer)
        if stager is None:
            views, nbytes = self._source_views(job.runs, job.heads)
            _send_frame(sock, ChunkHeader(job.room, job.chunk_id, dst_runs, heads, nbytes))
            _send_views(sock, views)
        else:
            src_heads = None if job.heads is None else (job.heads.src_head, job.heads.num_heads)
            num_heads = self.args.kv_heads if job.heads is None else job.heads.num_heads
            segment = stager.segment_pages(num_heads)
            _send_frame(sock, ChunkHeader(job.room, job.chunk_id, dst_runs, heads,
                                          job.num_pages * stager.page_bytes(num_heads), segment_pages=segment))
            stager.send(expand_pages([(r.src_page, r.num_pages) for r in job.runs]), src_heads, segment,
                        lambda view: _send_views(sock, [view]))
        ack = _recv_frame(sock)
        if not isinstance(ack, ChunkAck) or (ack.room, ack.chunk_id) != (job.room, job.chunk_id):
            raise TransferError(f"unexpected reply {ack!r} to room {job.room} chunk {job.chunk_id}")
        if ack.error:
            raise TransferError(f"decode rejected room {job.room} chunk {job.chunk_id}: {ack.error}")

    def _stager(self, key: PeerKey) -> PageStager | None:
        """The peer's staging pipeline when its jobs travel staged (either side on a GPU, or forced), else None."""
        with self._lock:
            stager, peer = self._stagers.get(key), self._peers.get(key)
        if stager is not None:
            return stager
        peer_on_device = peer is not None and peer.endpoint.get("device", "cpu") != "cpu"
        if not (self._stage_always or self._on_device or peer_on_device):
            return None
        stager = PageStager(self.args, self._segment_bytes)
        with self._lock:
            if key in self._peers:
                self._stagers[key] = stager
        return stager

    def _connection(self, key: PeerKey) -> socket.socket:
        with self._lock:
            sock, peer = self._socks.get(key), self._peers.get(key)
        if sock is not None:
            if not _closed_by_peer(sock):
                return sock
            with self._lock:  # the peer closed it between jobs (it restarted, dropped us, or a reset): reopen
                if self._socks.get(key) is sock:
                    del self._socks[key]
            _shutdown(sock)
        if peer is None or "port" not in peer.endpoint:
            raise TransferError("peer has no tcp endpoint")
        sock = socket.create_connection((peer.endpoint["host"], int(peer.endpoint["port"])), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = _recv_exact(sock, NONCE_BYTES)
        sock.settimeout(None)
        _send_frame(sock, DataHello(self.local.instance_id, self.local.epoch,
                                    data_proof(self.config.cluster_token, nonce, self.local.instance_id,
                                               self.local.epoch)))
        with self._lock:
            if self._closed or key not in self._peers:
                _shutdown(sock)
                raise TransferError("peer removed")
            self._socks[key] = sock
        return sock

    def _source_views(self, runs: tuple[PageRun, ...], heads: HeadSlice | None) -> tuple[list[memoryview], int]:
        item = self.args.item_len
        if heads is None:
            views = [view[r.src_page * item:(r.src_page + r.num_pages) * item]
                     for view in self._views for r in runs]
        else:
            ps, h = self.args.page_size, heads
            views = [_bytes_of(buf[r.src_page * ps:(r.src_page + r.num_pages) * ps,
                                   h.src_head:h.src_head + h.num_heads].contiguous())
                     for buf in self._buffers for r in runs]
        return views, sum(len(v) for v in views)

    # ---- decode: one reader thread per incoming connection ------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, remote = self._listener.accept()
            except OSError:
                return
            host = str(remote[0])
            with self._lock:
                admit = (self._conns_by_host.get(host, 0) < MAX_CONNS_PER_HOST
                         and sum(self._conns_by_host.values()) < MAX_CONNS)
                if admit:
                    self._conns_by_host[host] = self._conns_by_host.get(host, 0) + 1
                else:
                    self.refused_connections += 1
            if not admit:
                log.warning("kv tcp: refused a data connection from %s (connection limit)", host)
                _shutdown(sock)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock, host), name="kv-tcp-recv", daemon=True).start()

    def _authenticate(self, sock: socket.socket) -> PeerKey:
        """Challenge the connecting side; it must prove the cluster secret as a peer the control plane accepted."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        sock.settimeout(HELLO_TIMEOUT_S)
        sock.sendall(nonce)
        hello = _recv_frame(sock, MAX_HELLO_BYTES)
        sock.settimeout(None)
        if not isinstance(hello, DataHello):
            raise TransferError(f"expected DataHello, got {type(hello).__name__}")
        expected = data_proof(self.config.cluster_token, nonce, hello.instance_id, hello.epoch)
        if not hmac.compare_digest(expected, hello.proof):
            raise TransferError(f"data connection claiming {hello.instance_id} did not prove the cluster secret")
        return PeerKey(hello.instance_id, hello.epoch)

    def _serve(self, sock: socket.socket, host: str) -> None:
        try:
            key = self._authenticate(sock)
            with self._lock:
                if self._closed or key not in self._peers:
                    raise TransferError(f"data connection from {key.instance_id} which passed no handshake")
                self._accepted[sock] = key
            while True:
                header = _recv_frame(sock, self.max_frame_bytes)
                if not isinstance(header, ChunkHeader):
                    raise TransferError(f"expected ChunkHeader, got {type(header).__name__}")
                error = self._receive_chunk(sock, header)
                _send_frame(sock, ChunkAck(header.room, header.chunk_id, error))
        except (OSError, ConnectionError, TransferError, msgspec.DecodeError) as exc:
            log.debug("kv tcp: data connection closed: %s", exc)
        finally:
            with self._lock:
                self._accepted.pop(sock, None)
                self._conns_by_host[host] -= 1
                if not self._conns_by_host[host]:
                    del self._conns_by_host[host]
            _shutdown(sock)

    def _receive_chunk(self, sock: socket.socket, header: ChunkHeader) -> str:
        """Land one chunk's payload in the destination pages; "" or why it was refused (payload then discarded)."""
        a, ps, item = self.args, self.args.page_size, self.args.item_len
        heads = HeadSlice(*header.heads) if header.heads is not None else None
        bad = [r for r in header.dst_runs if r[0] < 1 or r[1] < 0 or r[0] + r[1] > a.num_pages]
        if heads is not None and not (heads.dst_head >= 0 and heads.num_heads > 0
                                      and heads.dst_head + heads.num_heads <= a.kv_heads):
            bad.append((-1, heads.dst_head))
        num_heads = a.kv_heads if heads is None else heads.num_heads
        nbytes = sum(n for _, n in header.dst_runs) * len(self._buffers) * ps * num_heads * a.head_dim \
            * self._buffers[0].element_size()
        if not 0 <= header.nbytes <= 2 * a.num_layers * a.num_pages * item:
            raise TransferError(f"chunk of {header.nbytes} bytes exceeds this rank's whole KV pool")
        problem = ""
        if bad or nbytes != header.nbytes:
            problem = f"destination runs {bad[:3]} or size {header.nbytes} do not fit this rank's buffers"
        elif header.segment_pages < 0 or (self._on_device and header.segment_pages == 0):
            problem = f"segment_pages {header.segment_pages}: GPU buffers take staged payloads only"
        if header.segment_pages > 0 or self._on_device:
            stager = getattr(self._recv_stager, "stager", None)
            if stager is None:
                stager = self._recv_stager.stager = PageStager(self.args, self._segment_bytes)
            segment_bytes = header.segment_pages * stager.page_bytes(num_heads)
            if not problem and segment_bytes > stager.capacity:
                problem = (f"segments of {segment_bytes} bytes exceed this rank's {stager.capacity}-byte staging "
                           "buffers (the sender's tcp stage_bytes must not exceed the receiver's)")
            if problem:
                stager.discard(header.nbytes, lambda view: _recv_views(sock, [view]))
                return problem
            dst_heads = None if heads is None else (heads.dst_head, heads.num_heads)
            stager.receive(expand_pages(header.dst_runs), dst_heads, header.segment_pages,
                           lambda view: _recv_views(sock, [view]))
            return ""
        if problem:
            _discard(sock, header.nbytes)
            return problem
        if heads is None:
            _recv_views(sock, [view[p * item:(p + n) * item] for view in self._views for p, n in header.dst_runs])
            return ""
        temps = [torch.empty((n * ps, heads.num_heads, a.head_dim), dtype=a.dtype)
                 for _ in self._buffers for _, n in header.dst_runs]
        _recv_views(sock, [_bytes_of(t) for t in temps])
        it = iter(temps)
        for buf in self._buffers:
            for p, n in header.dst_runs:
                buf[p * ps:(p + n) * ps, heads.dst_head:heads.dst_head + heads.num_heads].copy_(next(it))
        return ""


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle prefill-side connection is dead. The decode side sends only acks, so between jobs any
    readable state (EOF, a reset, stray bytes) means the stream cannot carry another job."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable)
    except (OSError, ValueError):
        return True


def _discard(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` through one bounded buffer."""
    buf = memoryview(bytearray(min(nbytes, DISCARD_BYTES)))
    while nbytes > 0:
        step = min(nbytes, len(buf))
        _recv_views(sock, [buf[:step]])
        nbytes -= step


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by the peer
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
