"""``tcp``: KV pages over plain TCP sockets, scatter/gather with ``sendmsg``/``recvmsg_into`` straight from the
source pages into the destination pages (no staging copy for whole pages). Works everywhere.

GPU buffers (either side) travel staged through pinned host buffers, overlapped per segment (``staging``): the
header's ``segment_pages`` > 0 says the payload is in the staged layout.

Striping: a job of at least 2 x ``stripe_bytes`` is cut into up to ``streams`` stripes of consecutive pages
(``split_runs``), each moved on its own connection by its own thread, so the copies into and out of the kernel run
on several cores at once (one TCP stream is bound by one core's copy: on loopback two streams move more bytes than
one, benchmarks/pages/kv_transfer.md). A stripe is a whole job on the wire (its own header and ack), so the decode
side needs no stripe logic; the job is done when every stripe is, and a failed stripe fails the job only after the
others have stopped.

Settings (``--kv-transfer-option``, checked and defaulted in ``common.kv_backends``): ``stage`` ("auto": stage when
either side's buffers are on a GPU; "always": stage CPU buffers too, the same byte path CI runs), ``stage_bytes``
(segment size, default 16 MiB), ``streams`` (connections per decode peer, 1..8, default 2), ``stripe_bytes``
(smallest stripe, default 4 MiB).

Connections per (prefill rank, decode peer, stream), opened lazily by the prefill side's per-peer worker. Stream::

    decode -> prefill   nonce (16 bytes)                                  once per connection: the challenge
    prefill -> decode   frame(DataHello)                                  its proof of the cluster secret
    prefill -> decode   frame(ChunkHeader) payload                        per job (per stripe)
    decode -> prefill   frame(ChunkAck)                                   per job, after the payload landed
    frame = u32 little-endian length + msgpack (``wire``);  payload = for layer: for K, V: for run: the run's bytes
                                                 (staged: for segment: see ``staging``)

The ack is what makes ``on_job_done(job, None)`` mean "in the destination pages" (see ``base.py``).

Listener bounds: nothing is allocated for a connection before its DataHello proves the secret for an accepted peer
(the hello frame is capped at ``MAX_HELLO_BYTES`` and must arrive within ``HELLO_TIMEOUT_S``); a frame never exceeds
``max_frame_bytes`` and a payload never exceeds what its header's destination runs hold. Until its hello, a connection
holds a slot of a ``ConnectionBudget`` (``MAX_CONNS_PER_HOST`` per remote host, ``MAX_CONNS`` in all; at a bound the
oldest unproven connection is closed to make room), so unproven connections cannot lock a prefill rank out; proven
ones are at most ``MAX_CONNS`` (one reader thread each).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hmac
import logging
import secrets
import socket
import threading

import msgspec
import torch

from common.kv_backends import int_option, option
from common.node.conn_budget import ConnectionBudget, Slot
from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.backends.base import BackendEvents, PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.staging import PageStager, expand_pages
from kvtransfer.backends.streamio import (
    closed_by_peer,
    discard,
    recv_exact,
    recv_frame,
    recv_views,
    send_frame,
    send_views,
    shutdown,
)
from kvtransfer.backends.wire import ChunkAck, ChunkHeader, DataHello, data_proof
from kvtransfer.backends.workers import QueuedBackend, TransferError
from kvtransfer.pages import HeadSlice, PageRun, split_runs

log = logging.getLogger(__name__)

NONCE_BYTES = 16
MAX_HELLO_BYTES = 1024
HELLO_TIMEOUT_S = 5.0
MAX_CONNS_PER_HOST = 32  # unproven, e.g. 8 prefill ranks on one host x 2 streams each, twice over
MAX_CONNS = 128  # unproven; and proven


def _unblock(sock: socket.socket) -> None:
    """End a connection whose slot was reclaimed: its reader's blocked read returns and the reader closes it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


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
        opts = config.backend_options
        self._stage_always = option("tcp", opts, "stage") == "always"
        self._segment_bytes = int_option("tcp", opts, "stage_bytes")
        self._streams = int_option("tcp", opts, "streams")
        self._stripe_bytes = int_option("tcp", opts, "stripe_bytes")
        self._stagers: dict[tuple[PeerKey, int], PageStager] = {}  # prefill: per (peer, stream): one thread each
        self._recv_stager = threading.local()  # decode: one per connection thread
        self._lock = threading.Lock()
        self._closed = False
        self._peers: dict[PeerKey, PeerInfo] = {}
        self._socks: dict[tuple[PeerKey, int], socket.socket] = {}  # prefill: connection per (decode peer, stream)
        self._accepted: dict[socket.socket, PeerKey | None] = {}  # decode: connections by sending peer
        self._unproven = ConnectionBudget("the tcp KV data port", MAX_CONNS_PER_HOST, MAX_CONNS)  # decode
        self._proven = 0  # decode: connections whose hello proved an accepted peer
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
            for stream in range(self._streams):
                self._stagers.pop((key, stream), None)
            socks = [s for s in (self._socks.pop((key, i), None) for i in range(self._streams)) if s is not None]
            socks += [s for s, k in self._accepted.items() if k == key]
        super().remove_peer(key)
        for sock in socks:
            shutdown(sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [*self._socks.values(), *self._accepted]
            self._socks.clear()
        for sock in socks:
            shutdown(sock)
        if self._listener is not None:
            shutdown(self._listener)
        super().close()

    # ---- prefill: one worker thread per peer --------------------------------------------------------------------
    def _move(self, job: TransferJob) -> None:
        stripes = self._stripes(job)
        if len(stripes) == 1:
            self._move_stripe(job, 0)
            return
        errors: list[Exception | None] = [None] * len(stripes)

        def move(stream: int) -> None:
            try:
                self._move_stripe(stripes[stream], stream)
            except Exception as exc:  # re-raised on the worker thread below, after every stripe stopped
                errors[stream] = exc

        threads = [threading.Thread(target=move, args=(k,), daemon=True, name=f"kv-tcp-stripe{k}")
                   for k in range(1, len(stripes))]
        for thread in threads:
            thread.start()
        move(0)
        # No deadline of its own: a stripe blocks only in its socket, and a dead or removed peer's sockets are shut
        # down (remove_peer/close), which ends it. Waiting for all keeps "no write after on_job_done".
        for thread in threads:
            thread.join()
        failed = [exc for exc in errors if exc is not None]
        if failed:
            raise failed[0]

    def _stripes(self, job: TransferJob) -> list[TransferJob]:
        """``job`` cut into stripes of about ``stripe_bytes`` or more (whole pages), at most one per stream."""
        num_heads = self.args.kv_heads if job.heads is None else job.heads.num_heads
        parts = min(self._streams, job.num_pages, job.num_pages * self._page_bytes(num_heads) // self._stripe_bytes)
        if parts <= 1:
            return [job]
        return [dataclasses.replace(job, runs=runs) for runs in split_runs(job.runs, parts)]

    def _page_bytes(self, num_heads: int) -> int:
        """Payload bytes of one page over every layer's K and V, ``num_heads`` heads per slot."""
        a = self.args
        return len(self._buffers) * a.page_size * num_heads * a.head_dim * self._buffers[0].element_size()

    def _move_stripe(self, job: TransferJob, stream: int) -> None:
        sock = self._connection(job.peer, stream)
        try:
            self._move_on(sock, job, stream)
        except (OSError, ConnectionError, msgspec.DecodeError, TransferError) as exc:
            # The stream is in an unknown state (half a payload, a stale ack, a peer that closed it): drop the
            # connection so the peer's next job opens a fresh one instead of failing on a dead socket forever.
            with self._lock:
                if self._socks.get((job.peer, stream)) is sock:
                    del self._socks[(job.peer, stream)]
            shutdown(sock)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"connection to {job.peer.instance_id} lost ({exc}); reconnecting") from exc

    def _move_on(self, sock: socket.socket, job: TransferJob, stream: int) -> None:
        heads = None if job.heads is None else (job.heads.src_head, job.heads.dst_head, job.heads.num_heads)
        dst_runs = [(r.dst_page, r.num_pages) for r in job.runs]
        stager = self._stager(job.peer, stream)
        if stager is None:
            views, nbytes = self._source_views(job.runs, job.heads)
            send_frame(sock, ChunkHeader(job.room, job.chunk_id, dst_runs, heads, nbytes))
            send_views(sock, views)
        else:
            src_heads = None if job.heads is None else (job.heads.src_head, job.heads.num_heads)
            num_heads = self.args.kv_heads if job.heads is None else job.heads.num_heads
            segment = stager.segment_pages(num_heads)
            send_frame(sock, ChunkHeader(job.room, job.chunk_id, dst_runs, heads,
                                         job.num_pages * stager.page_bytes(num_heads), segment_pages=segment))
            stager.send(expand_pages([(r.src_page, r.num_pages) for r in job.runs]), src_heads, segment,
                        lambda view: send_views(sock, [view]))
        ack = recv_frame(sock)
        if not isinstance(ack, ChunkAck) or (ack.room, ack.chunk_id) != (job.room, job.chunk_id):
            raise TransferError(f"unexpected reply {ack!r} to room {job.room} chunk {job.chunk_id}")
        if ack.error:
            raise TransferError(f"decode rejected room {job.room} chunk {job.chunk_id}: {ack.error}")

    def _stager(self, key: PeerKey, stream: int) -> PageStager | None:
        """The stream's staging pipeline when the peer's jobs travel staged (either side on a GPU, or forced)."""
        with self._lock:
            stager, peer = self._stagers.get((key, stream)), self._peers.get(key)
        if stager is not None:
            return stager
        peer_on_device = peer is not None and peer.endpoint.get("device", "cpu") != "cpu"
        if not (self._stage_always or self._on_device or peer_on_device):
            return None
        stager = PageStager(self.args, self._segment_bytes)
        with self._lock:
            if key in self._peers:
                self._stagers[(key, stream)] = stager
        return stager

    def _connection(self, key: PeerKey, stream: int) -> socket.socket:
        with self._lock:
            sock, peer = self._socks.get((key, stream)), self._peers.get(key)
        if sock is not None:
            if not closed_by_peer(sock):
                return sock
            with self._lock:  # the peer closed it between jobs (it restarted, dropped us, or a reset): reopen
                if self._socks.get((key, stream)) is sock:
                    del self._socks[(key, stream)]
            shutdown(sock)
        if peer is None or "port" not in peer.endpoint:
            raise TransferError("peer has no tcp endpoint")
        sock = socket.create_connection((peer.endpoint["host"], int(peer.endpoint["port"])), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = recv_exact(sock, NONCE_BYTES)
        sock.settimeout(None)
        send_frame(sock, DataHello(self.local.instance_id, self.local.epoch,
                                    data_proof(self.config.cluster_token, nonce, self.local.instance_id,
                                               self.local.epoch)))
        with self._lock:
            if self._closed or key not in self._peers:
                shutdown(sock)
                raise TransferError("peer removed")
            self._socks[(key, stream)] = sock
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
            slot = self._unproven.admit(str(remote[0]), functools.partial(_unblock, sock))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock, slot), name="kv-tcp-recv", daemon=True).start()

    def _authenticate(self, sock: socket.socket) -> PeerKey:
        """Challenge the connecting side; it must prove the cluster secret as a peer the control plane accepted."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        sock.settimeout(HELLO_TIMEOUT_S)
        sock.sendall(nonce)
        hello = recv_frame(sock, MAX_HELLO_BYTES)
        sock.settimeout(None)
        if not isinstance(hello, DataHello):
            raise TransferError(f"expected DataHello, got {type(hello).__name__}")
        expected = data_proof(self.config.cluster_token, nonce, hello.instance_id, hello.epoch)
        if not hmac.compare_digest(expected, hello.proof):
            raise TransferError(f"data connection claiming {hello.instance_id} did not prove the cluster secret")
        return PeerKey(hello.instance_id, hello.epoch)

    def _serve(self, sock: socket.socket, slot: Slot) -> None:
        proven = False
        try:
            key = self._authenticate(sock)
            with self._lock:
                if self._closed or key not in self._peers:
                    raise TransferError(f"data connection from {key.instance_id} which passed no handshake")
                if self._proven >= MAX_CONNS:
                    self.refused_connections += 1
                    raise TransferError(f"data connection from {key.instance_id}: {MAX_CONNS} proven connections "
                                        "are open already")
                self._accepted[sock] = key
                self._proven += 1
                proven = True
            self._unproven.release(slot)
            while True:
                header = recv_frame(sock, self.max_frame_bytes)
                if not isinstance(header, ChunkHeader):
                    raise TransferError(f"expected ChunkHeader, got {type(header).__name__}")
                error = self._receive_chunk(sock, header)
                send_frame(sock, ChunkAck(header.room, header.chunk_id, error))
        except (OSError, ConnectionError, TransferError, msgspec.DecodeError) as exc:
            log.debug("kv tcp: data connection closed: %s", exc)
        finally:
            self._unproven.release(slot)
            with self._lock:
                self._accepted.pop(sock, None)
                self._proven -= proven
            shutdown(sock)

    def _receive_chunk(self, sock: socket.socket, header: ChunkHeader) -> str:
        """Land one chunk's payload in the destination pages; "" or why it was refused (payload then discarded)."""
        a, ps, item = self.args, self.args.page_size, self.args.item_len
        heads = HeadSlice(*header.heads) if header.heads is not None else None
        bad = [r for r in header.dst_runs if r[0] < 1 or r[1] < 0 or r[0] + r[1] > a.num_pages]
        if heads is not None and not (heads.dst_head >= 0 and heads.num_heads > 0
                                      and heads.dst_head + heads.num_heads <= a.kv_heads):
            bad.append((-1, heads.dst_head))
        num_heads = a.kv_heads if heads is None else heads.num_heads
        nbytes = sum(n for _, n in header.dst_runs) * self._page_bytes(num_heads)
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
                stager.discard(header.nbytes, lambda view: recv_views(sock, [view]))
                return problem
            dst_heads = None if heads is None else (heads.dst_head, heads.num_heads)
            stager.receive(expand_pages(header.dst_runs), dst_heads, header.segment_pages,
                           lambda view: recv_views(sock, [view]))
            return ""
        if problem:
            discard(sock, header.nbytes)
            return problem
        if heads is None:
            recv_views(sock, [view[p * item:(p + n) * item] for view in self._views for p, n in header.dst_runs])
            return ""
        temps = [torch.empty((n * ps, heads.num_heads, a.head_dim), dtype=a.dtype)
                 for _ in self._buffers for _, n in header.dst_runs]
        recv_views(sock, [_bytes_of(t) for t in temps])
        it = iter(temps)
        for buf in self._buffers:
            for p, n in header.dst_runs:
                buf[p * ps:(p + n) * ps, heads.dst_head:heads.dst_head + heads.num_heads].copy_(next(it))
        return ""
