"""``KVManager``: one per scheduler rank. Owns the control plane, the data-plane backend, the peers and the rooms.

Threads: the scheduler thread creates ``KVSender``/``KVReceiver`` handles and calls their non-blocking methods;
the control thread (``control.ControlPlane``) handles every incoming message, backend completion, bootstrap
lookup result and the periodic sweep (deadlines, heartbeats). Shared state is guarded by ``self.lock``; nothing
blocking runs under it. Bootstrap gRPC calls run on a small executor and report back through ``call_soon``.

Peers: a peer is one start (``PeerKey(instance_id, epoch)``) of a rank on the other side that passed the
handshake (challenge-response over the cluster secret, protocol version, compatibility) and shares a session key
with us (``kvtransfer/auth.py``). A message without a valid MAC of an accepted peer's session is dropped and counted
in ``auth_drops``; a restarted instance proves itself in a new handshake, which replaces the old peer.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from common.errors import ErrorCode
from kvtransfer import auth
from kvtransfer.args import KVArgs, KVLayout, KVTransferConfig, Mode
from kvtransfer.backends.base import PeerInfo, PeerKey, TransferJob
from kvtransfer.bootstrap import BootstrapClient, BootstrapError, RankEntry
from kvtransfer.control import ControlPlane
from kvtransfer.messages import (
    PROTOCOL_VERSION,
    AnyMessage,
    Heartbeat,
    Hello,
    HelloAck,
    HelloChallenge,
    HelloProof,
)
from kvtransfer.metadata import MetadataBuffers
from kvtransfer.registry import make_backend

log = logging.getLogger(__name__)


@dataclass
class Peer:
    key: PeerKey
    control_addr: str
    layout: KVLayout
    last_seen: float
    session_key: bytes
    send_seq: int = 0  # last sequence number sealed toward the peer
    recv_seq: int = 0  # last sequence number accepted from the peer

    def describe(self) -> str:
        return f"{self.key.instance_id} (epoch {self.key.epoch})"


class Rooms(Protocol):
    """One role's room logic (``prefill_rooms.PrefillRooms``, ``decode_rooms.DecodeRooms``), built by ``KVManager``.

    Every method takes ``mgr.lock`` itself where it touches shared state; none blocks.
    """

    mode: ClassVar[Mode]  # the role; the manager's data-plane backend is built for it

    def __init__(self, mgr: KVManager) -> None: ...

    # ---- scheduler thread, through the role's handle (``KVSender``/``KVReceiver``) -----------------------------
    def abort(self, rec: Any, code: ErrorCode, reason: str) -> None:
        """Fail ``rec`` (one of this role's records) with ``code`` here and on its peers."""

    def clear(self, rec: Any) -> None:
        """Forget ``rec`` once quiesced; an open one is failed first."""

    # ---- control thread, from ``KVManager`` --------------------------------------------------------------------
    def handshake(self, msg: Hello | HelloChallenge | HelloProof | HelloAck, frames: list[bytes]) -> None:
        """One handshake message (not sealed with a session yet; ``frames`` carry its MAC if any)."""

    def handle(self, msg: AnyMessage, peer: Peer) -> None:
        """One message sealed by ``peer``'s session (heartbeats excluded)."""

    def job_done(self, job: TransferJob, error: str | None) -> None:
        """A data-plane job finished (``error`` None) or failed."""

    def job_enqueued(self, job: TransferJob, signal: int) -> None:
        """A signalled job's copy is enqueued; landing signal ``signal`` is set behind it."""

    def peer_lost(self, key: PeerKey, reason: str) -> None:
        """The peer died or restarted: fail the rooms it serves (UNAVAILABLE)."""

    def flush(self) -> None:
        """The control thread handled the messages that arrived together: send what they made it batch."""

    def tick(self, now: float) -> bool:
        """The periodic sweep: deadlines, retries, forgetting old rooms. True while a room is open (its deadlines
        and retries need the short tick); False lets the control thread sleep until the next heartbeat."""

    def close(self, reason: str) -> None:
        """The manager closes (any thread): fail every open room (UNAVAILABLE)."""


class KVManager:
    """KV transfer endpoint of one scheduler rank; ``rooms`` is the role's room logic
    (``prefill_rooms.PrefillRooms`` or ``decode_rooms.DecodeRooms``) and fixes ``mode`` ("prefill" or "decode")."""

    def __init__(self, args: KVArgs, config: KVTransferConfig, rooms: type[Rooms],
                 bootstrap_addr: str | None = None, dp_size: int = 1) -> None:
        mode = rooms.mode
        if mode == "prefill" and bootstrap_addr is None:
            raise ValueError("a prefill KVManager needs bootstrap_addr (the prefill node's Bootstrap service)")
        self.args, self.config, self.mode = args, config, mode
        self.bootstrap_addr, self.dp_size = bootstrap_addr, dp_size
        self.lock = threading.RLock()
        self.epoch = time.time_ns()
        self.peers: dict[str, Peer] = {}  # instance_id -> the accepted start of that instance
        self.auth_drops = auth.DropCounter()  # control messages dropped as forged, replayed or unproven
        self.metadata = MetadataBuffers(args.num_metadata_slots, args.draft_state_dims)
        self.layout = args.layout(config.fingerprint)
        self._closed = False
        self._next_heartbeat = 0.0
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"kv-{mode}-bootstrap")
        self._clients: dict[str, BootstrapClient] = {}
        self.control = ControlPlane(config.host, config.control_port, self._on_message, self._on_tick,
                                    advertise_host=config.advertise_host, on_drained=self._on_drained)
        self.instance_id = f"{mode}/dp{args.dp_rank}/tp{args.tp_rank}@{self.control.address}"
        self.backend = make_backend(args, config, mode, self, PeerKey(self.instance_id, self.epoch))
        self.endpoint = self.backend.endpoint()
        self.rooms: Rooms = rooms(self)
        self.control.start()
        if mode == "prefill":
            self._executor.submit(self._register_forever)

    # ---- identity and messaging -------------------------------------------------------------------------------
    def stamp(self) -> dict[str, object]:
        """The (instance_id, epoch) every outgoing message carries."""
        return {"instance_id": self.instance_id, "epoch": self.epoch}

    def send_to(self, key: PeerKey, msg: AnyMessage) -> None:
        """Send ``msg`` sealed with the peer's session; nothing goes to a peer that has not proven the secret."""
        with self.lock:  # NOTE: seq assignment and queueing are atomic, so seqs leave in increasing order
            peer = self.peers.get(key.instance_id)
            if peer is not None and peer.key == key:
                peer.send_seq += 1
                self.control.send(peer.control_addr, msg, (peer.session_key, peer.send_seq))

    def bootstrap_client(self, addr: str) -> BootstrapClient:
        with self.lock:
            client = self._clients.get(addr)
            if client is None:
                client = self._clients[addr] = BootstrapClient(addr)
            return client

    def run_in_background(self, fn, *args) -> None:
        """Run a blocking call (a bootstrap lookup) off the control and scheduler threads."""
        if not self._closed:
            self._executor.submit(fn, *args)

    # ---- backend events (any backend thread) ------------------------------------------------------------------
    def on_job_done(self, job: TransferJob, error: str | None) -> None:
        self.control.call_soon(lambda: self.rooms.job_done(job, error))

    def on_job_enqueued(self, job: TransferJob, signal: int) -> None:
        self.control.call_soon(lambda: self.rooms.job_enqueued(job, signal))

    # ---- peers -------------------------------------------------------------------------------------------------
    def accept_peer(self, key: PeerKey, control_addr: str, layout: KVLayout, endpoint: dict[str, str],
                    session_key: bytes, recv_seq: int = 0) -> Peer:
        """Register a peer that passed the handshake (replacing an older epoch of the same instance).

        A handshake from the very start we already accepted means the peer lost us (it stalled past the heartbeat
        deadline, or dropped us): its rooms and data connections here are stale, so they fail and are replaced
        (with the new session key).
        """
        with self.lock:
            old = self.peers.get(key.instance_id)
            if old is not None:
                why = "handshook again (it had lost this rank)" if old.key == key else f"restarted (new epoch {key.epoch})"
                self.lose_peer(old.key, f"{old.describe()} {why}")
            peer = self.peers[key.instance_id] = Peer(key, control_addr, layout, time.monotonic(), session_key,
                                                      recv_seq=recv_seq)
        self.backend.add_peer(PeerInfo(key, layout, endpoint, auth.pairing_id(session_key)))
        log.info("kv %s: peer %s accepted", self.instance_id, peer.describe())
        return peer

    def lose_peer(self, key: PeerKey, reason: str) -> None:
        """The peer is dead or restarted: fail its rooms, drop its connections."""
        with self.lock:
            peer = self.peers.get(key.instance_id)
            if peer is None or peer.key != key:
                return
            del self.peers[key.instance_id]
        log.warning("kv %s: lost peer: %s", self.instance_id, reason)
        self.rooms.peer_lost(key, reason)
        self.backend.remove_peer(key)
        self.control.forget(peer.control_addr)

    # ---- control thread ----------------------------------------------------------------------------------------
    def _on_message(self, msg: AnyMessage, frames: list[bytes]) -> None:
        if msg.version != PROTOCOL_VERSION:
            log.warning("kv %s: dropped %s of protocol version %d (ours is %d) from %s", self.instance_id,
                        type(msg).__name__, msg.version, PROTOCOL_VERSION, msg.instance_id)
            if isinstance(msg, Hello):
                self.control.send(msg.control_addr, HelloAck(**self.stamp(), accepted=False, hello_nonce=msg.nonce,
                                                             reason=f"protocol version mismatch: prefill="
                                                                    f"{PROTOCOL_VERSION} decode={msg.version}"))
            return
        if isinstance(msg, Hello | HelloChallenge | HelloProof | HelloAck):
            self.rooms.handshake(msg, frames)
            return
        with self.lock:
            peer = self.peers.get(msg.instance_id)
            seq = None
            if peer is not None and peer.key.epoch == msg.epoch:
                seq = auth.open_seal(peer.session_key, peer.recv_seq, frames)
            if peer is None or seq is None:
                self.auth_drops.add("unknown_peer" if peer is None else "bad_mac")
                log.debug("kv %s: dropped %s claiming %s epoch %d: not sealed by that peer's session",
                          self.instance_id, type(msg).__name__, msg.instance_id, msg.epoch)
                return
            peer.recv_seq = seq
            peer.last_seen = time.monotonic()
        if not isinstance(msg, Heartbeat):
            self.rooms.handle(msg, peer)

    def _on_drained(self) -> None:
        self.rooms.flush()

    def _on_tick(self) -> float:
        """Seconds the next tick may wait: the control plane's short tick while a room is open, else until the
        next heartbeat (``create`` of a room calls ``tick_soon``)."""
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval_s
            with self.lock:
                peers = list(self.peers.values())
            for peer in peers:
                silent = now - peer.last_seen
                if silent > self.config.peer_dead_after_s:
                    self.lose_peer(peer.key, f"{peer.describe()} at {peer.control_addr} silent for {silent:.1f}s "
                                             f"(heartbeat every {self.config.heartbeat_interval_s}s)")
                else:
                    self.send_to(peer.key, Heartbeat(**self.stamp()))
        busy = self.rooms.tick(now)
        return 0.0 if busy else self._next_heartbeat - time.monotonic()

    def _register_forever(self) -> None:
        """Prefill: register this rank with the Bootstrap service, retrying until it answers (or we close)."""
        assert self.bootstrap_addr is not None
        client = self.bootstrap_client(self.bootstrap_addr)
        entry = RankEntry(self.control.address, self.instance_id, self.epoch)
        delay = 0.05
        while not self._closed:
            try:
                client.register(self.args.dp_rank, self.args.tp_rank, self.dp_size, self.args.tp_size, entry,
                                self.config.cluster_token)
                return
            except BootstrapError as exc:
                log.warning("kv %s: bootstrap registration at %s failed (%s); retrying", self.instance_id,
                            self.bootstrap_addr, exc)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def close(self) -> None:
        """Stop threads and release sockets, mappings and the backend. Rooms still open are failed."""
        if self._closed:
            return
        self._closed = True
        self.rooms.close("KV manager closed")
        self.control.close()
        self.backend.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for client in self._clients.values():
            client.close()
