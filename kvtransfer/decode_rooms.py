"""Decode side: ``DecodeRooms``, the manager's room logic (a ``manager.Rooms``) behind each ``receiver.KVReceiver``,
and its per-room record ``RecvRoom``.

Resolution is event-driven on the control thread (``_pump``): bootstrap lookups run on the manager's executor and
are cached per bootstrap address; the handshake with each prefill rank start is ``decode_handshake``'s, and every
room waiting on it moves on when it ends. ``send_metadata`` may come before the handshake finished; its TransferInfo is sent
as soon as the sources are known. Invariant: after a local failure the room stays not-quiesced until every source
that got a TransferInfo acked the Abort, died, or ``abort_ack_timeout_s`` passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import grpc

from common.errors import ErrorCode
from kvtransfer.args import Mode
from kvtransfer.backends.base import PeerKey, TransferJob
from kvtransfer.bootstrap import BootstrapError, RankEntry
from kvtransfer.decode_handshake import DecodeHandshakes
from kvtransfer.landing import LandingWatch
from kvtransfer.messages import (
    Abort,
    AbortAck,
    AnyMessage,
    ChunkDone,
    Hello,
    HelloAck,
    HelloChallenge,
    HelloProof,
    Status,
    TransferInfo,
)
from kvtransfer.metadata import MetadataRecord
from kvtransfer.pages import HeadSlice, pages_outside, source_plan
from kvtransfer.poll import KVPoll
from kvtransfer.room_record import RoomRecord

if TYPE_CHECKING:
    from kvtransfer.manager import KVManager, Peer

log = logging.getLogger(__name__)

LOOKUP_RETRY_S = 0.2
# A peer silent this many heartbeat intervals may have restarted on the same address (a new epoch registered at its
# bootstrap) or stalled: a new room binds to it only once a lookup made since then still names that start. Until
# then (a lookup that fails does not count) the room waits, for the new start's registration, the peer's heartbeats
# or its death (whose rank entries are dropped, so the room looks the rank up from scratch), within its deadline.
SUSPECT_HEARTBEATS = 2


@dataclass
class Source:
    """One prefill rank this decode room takes heads from."""

    tp_rank: int
    heads: HeadSlice
    key: PeerKey | None = None
    chunks: int = 0
    num_chunks: int = 0  # 0 until the final ChunkDone
    info_sent: bool = False

    @property
    def complete(self) -> bool:
        return self.num_chunks > 0 and self.chunks == self.num_chunks


@dataclass
class RecvRoom(RoomRecord):
    bootstrap_addr: str = ""
    dp_rank: int | None = None
    sources: list[Source] | None = None
    dst_pages: list[int] | None = None
    metadata_slot: int | None = None
    metadata_ok: bool = False


class DecodeRooms:
    mode: ClassVar[Mode] = "decode"

    def __init__(self, mgr: KVManager) -> None:
        self.mgr = mgr
        self.rooms: dict[int, RecvRoom] = {}
        self.topology: dict[str, tuple[int, int]] = {}  # bootstrap addr -> (dp_size, tp_size)
        self.ranks: dict[tuple[str, int, int], RankEntry] = {}  # (addr, dp, tp) -> entry
        self.looked_up: dict[tuple[str, int, int], float] = {}  # (addr, dp, tp) -> when a lookup last found it
        self.lookups: dict[tuple[str, int, int], float] = {}  # in flight (inf) or retry-after time
        self.handshakes = DecodeHandshakes(mgr, self._pump_all)
        self.confirmations: dict[PeerKey, list[int]] = {}  # rooms whose Success each peer has not been sent yet
        self.landing = LandingWatch(mgr, self._chunk_done, lambda rec, why, now: self.fail(
            rec, ErrorCode.UNAVAILABLE, why, now), self.flush)  # chunks announced before their copy landed

    # ---- scheduler thread -------------------------------------------------------------------------------------
    def create(self, room: int, bootstrap_addr: str) -> RecvRoom:
        now = time.monotonic()
        with self.mgr.lock:
            rec = RecvRoom(room, self.mgr.config, now, bootstrap_addr=bootstrap_addr,
                           waiting_for=f"bootstrap {bootstrap_addr}")
            if room in self.rooms:
                rec.fail(ErrorCode.UNAVAILABLE, f"room {room}: duplicate bootstrap room (already in flight on this decode rank)", now)
                rec.quiesced = True
            else:
                self.rooms[room] = rec
        self.mgr.control.tick_soon()  # its deadline and bootstrap retries need the short tick
        return rec

    def init(self, rec: RecvRoom, dp_rank: int) -> None:
        with self.mgr.lock:
            rec.dp_rank = dp_rank
        self.mgr.control.call_soon(lambda: self._pump(rec))

    def send_metadata(self, rec: RecvRoom, pages: Sequence[int], slot: int) -> None:
        bad = pages_outside([p for p in pages if p != 0], self.mgr.args.num_pages)  # 0: a page held already
        if bad or not 0 <= slot < self.mgr.args.num_metadata_slots:
            raise ValueError(f"room {rec.room}: pages {bad[:5]} outside [1, {self.mgr.args.num_pages}) or metadata "
                             f"slot {slot} outside [0, {self.mgr.args.num_metadata_slots})")
        with self.mgr.lock:
            if rec.state.is_final or rec.dst_pages is not None:
                return
            rec.dst_pages, rec.metadata_slot = list(pages), slot
            self.mgr.metadata.clear(slot)
            rec.progress(time.monotonic())
            self._send_infos(rec)

    def abort(self, rec: RecvRoom, code: ErrorCode, reason: str) -> None:
        with self.mgr.lock:
            self.fail(rec, code, reason, time.monotonic())

    def clear(self, rec: RecvRoom) -> None:
        with self.mgr.lock:
            if self.rooms.get(rec.room) is not rec:
                return
            if not rec.state.is_final:
                self.fail(rec, ErrorCode.CANCELLED, f"room {rec.room}: cleared while {rec.state.name}", time.monotonic())
            if rec.quiesced:
                del self.rooms[rec.room]
                if rec.metadata_slot is not None:
                    self.mgr.metadata.clear(rec.metadata_slot)

    # ---- control thread ---------------------------------------------------------------------------------------
    def handshake(self, msg: Hello | HelloChallenge | HelloProof | HelloAck, frames: list[bytes]) -> None:
        self.handshakes.handle(msg, frames)

    def handle(self, msg: AnyMessage, peer: Peer) -> None:
        now = time.monotonic()
        with self.mgr.lock:
            rec = self.rooms.get(getattr(msg, "room", -1))
            if isinstance(msg, Abort):
                self.mgr.send_to(peer.key, AbortAck(**self.mgr.stamp(), room=msg.room))
            if rec is None:
                return
            source = next((s for s in rec.sources or () if s.key == peer.key), None)
            if source is None:
                return
            if isinstance(msg, ChunkDone):
                self.landing.chunk(rec, source, msg, now)
            elif isinstance(msg, Abort) or (isinstance(msg, Status) and msg.state == KVPoll.Failed):
                what = "aborted" if isinstance(msg, Abort) else "failed"
                rec.unacked.discard(peer.key)  # it has nothing in flight for this room any more
                self.fail(rec, msg.code, f"room {rec.room}: prefill {peer.describe()} {what} the room: {msg.reason}",
                          now, skip=peer.key)
                rec.peer_quiesced(peer.key)
            elif isinstance(msg, AbortAck):
                rec.peer_quiesced(peer.key)

    def job_done(self, job: TransferJob, error: str | None) -> None:
        """Decode backends never get jobs."""

    def job_enqueued(self, job: TransferJob, signal: int) -> None:
        """Decode backends never get jobs."""

    def peer_lost(self, key: PeerKey, reason: str) -> None:
        now = time.monotonic()
        with self.mgr.lock:
            for cache_key, entry in list(self.ranks.items()):
                if entry.instance_id == key.instance_id:
                    del self.ranks[cache_key]
            for rec in list(self.rooms.values()):
                if any(s.key == key for s in rec.sources or ()):
                    self.fail(rec, ErrorCode.UNAVAILABLE, f"room {rec.room}: {reason} while {rec.state.name}", now, skip=key)
                    rec.peer_quiesced(key)

    def tick(self, now: float) -> bool:
        with self.mgr.lock:
            busy = False
            for rec in list(self.rooms.values()):
                if rec.expired(now):
                    self.fail(rec, ErrorCode.DEADLINE_EXCEEDED, rec.expiry_reason(), now)
                elif rec.state == KVPoll.Failed and not rec.quiesced and now > rec.ack_deadline:
                    log.warning("kv %s: room %d: no abort ack from %s within %.1fs; treating pages as free",
                                self.mgr.instance_id, rec.room, sorted(k.instance_id for k in rec.unacked),
                                self.mgr.config.abort_ack_timeout_s)
                    rec.unacked.clear()
                    rec.quiesced = True
                elif rec.state.is_final and rec.quiesced and now - rec.finished_at > self.mgr.config.tombstone_s:
                    del self.rooms[rec.room]
                busy = busy or not (rec.state.is_final and rec.quiesced)
            pending = [r for r in self.rooms.values() if r.state == KVPoll.Bootstrapping and r.dp_rank is not None]
        for rec in pending:
            self._pump(rec)
        return busy

    def close(self, reason: str) -> None:
        with self.mgr.lock:
            for rec in self.rooms.values():
                self.fail(rec, ErrorCode.UNAVAILABLE, reason, time.monotonic())
        self.landing.close()

    # ---- internals ----------------------------------------------------------------------------------------------
    def fail(self, rec: RecvRoom, code: ErrorCode, reason: str, now: float, skip: PeerKey | None = None) -> bool:
        """Fail the room and send Abort to every source that may still write into its pages (except ``skip``)."""
        if not rec.fail(code, reason, now):
            return False
        log.log(code.log_level, "kv %s: %s", self.mgr.instance_id, reason)
        for source in rec.sources or ():
            if source.key is not None and source.info_sent and source.key != skip \
                    and source.key.instance_id in self.mgr.peers:
                rec.unacked.add(source.key)
                self.mgr.send_to(source.key, Abort(**self.mgr.stamp(), room=rec.room, reason=reason, code=code))
        rec.quiesced = not rec.unacked
        return True

    def _chunk_done(self, rec: RecvRoom, source: Source, msg: ChunkDone, now: float) -> None:
        if rec.state.is_final:
            return
        source.chunks += 1
        rec.advance(KVPoll.Transferring, now)
        rec.progress(now)
        rec.waiting_for = "the remaining chunks"
        if msg.metadata is not None:
            self._land_metadata(rec, msg.metadata, now)
        if msg.num_chunks:
            source.num_chunks = msg.num_chunks
            if source.chunks != msg.num_chunks:
                self.fail(rec, ErrorCode.UNAVAILABLE, f"room {rec.room}: prefill {source.key} reported {msg.num_chunks} chunks but "
                               f"{source.chunks} arrived", now)
                return
        if rec.state == KVPoll.Transferring and rec.metadata_ok and all(s.complete for s in rec.sources or ()):
            rec.advance(KVPoll.Success, now)
            for s in rec.sources or ():
                if s.key is not None:  # sent by flush, with the other rooms the same messages completed
                    self.confirmations.setdefault(s.key, []).append(rec.room)

    def flush(self) -> None:
        """Control thread, after the messages that arrived together: each peer's Success confirmations in one Status
        (rooms in flight at once complete in bursts; one message each was a round trip's worth of host work)."""
        with self.mgr.lock:
            pending, self.confirmations = self.confirmations, {}
            for key, rooms in pending.items():
                self.mgr.send_to(key, Status(**self.mgr.stamp(), room=rooms[0], rooms=rooms[1:],
                                             state=KVPoll.Success))

    def _land_metadata(self, rec: RecvRoom, record: MetadataRecord, now: float) -> None:
        slot = rec.metadata_slot
        if slot is None or record.room != rec.room:
            self.fail(rec, ErrorCode.UNAVAILABLE, f"room {rec.room}: metadata record for room {record.room} (slot {slot})", now)
            return
        try:
            self.mgr.metadata.write(slot, record)
        except ValueError as e:  # the prefill node's draft head is not this node's
            self.fail(rec, ErrorCode.FAILED_PRECONDITION, str(e), now)
            return
        if self.mgr.metadata.room_of(slot) != rec.room:
            self.fail(rec, ErrorCode.INTERNAL, f"room {rec.room}: context corruption: metadata slot {slot} holds room "
                           f"{self.mgr.metadata.room_of(slot)}", now)
            return
        rec.metadata_ok = True

    def _send_infos(self, rec: RecvRoom) -> None:
        if rec.dst_pages is None or rec.metadata_slot is None or rec.state != KVPoll.WaitingForInput:
            return
        for source in rec.sources or ():
            if not source.info_sent and source.key is not None:
                source.info_sent = True
                self.mgr.send_to(source.key, TransferInfo(
                    **self.mgr.stamp(), room=rec.room, dst_pages=rec.dst_pages, metadata_slot=rec.metadata_slot,
                    landing_signals=self.mgr.backend.signal_reader(source.key) is not None))
        rec.waiting_for = "the first chunk from prefill"

    def _pump_all(self) -> None:
        with self.mgr.lock:
            pending = [r for r in self.rooms.values() if r.state == KVPoll.Bootstrapping and r.dp_rank is not None]
        for rec in pending:
            self._pump(rec)

    def _pump(self, rec: RecvRoom) -> None:
        """Move a Bootstrapping room as far as cached knowledge allows; start lookups/handshakes for the rest."""
        now = time.monotonic()
        with self.mgr.lock:
            if rec.state != KVPoll.Bootstrapping or rec.dp_rank is None:
                return
            addr, me = rec.bootstrap_addr, self.mgr.layout
            topo = self.topology.get(addr)
            if topo is None:
                rec.waiting_for = f"the topology from bootstrap {addr}"
                self._lookup(addr, -1, -1, now)
                return
            dp_size, tp_size = topo
            if not 0 <= rec.dp_rank < dp_size:
                self.fail(rec, ErrorCode.FAILED_PRECONDITION,
                          f"room {rec.room}: prefill_dp_rank {rec.dp_rank} outside dp_size {dp_size} of {addr}", now)
                return
            if rec.sources is None:
                plan = source_plan(me.tp_rank, me.tp_size, tp_size, me.total_kv_heads)
                rec.sources = [Source(tp, heads) for tp, heads in plan]
            for source in rec.sources:
                if source.key is not None:
                    continue
                entry = self.ranks.get((addr, rec.dp_rank, source.tp_rank))
                if entry is None:
                    rec.waiting_for = f"prefill rank dp={rec.dp_rank} tp={source.tp_rank} from bootstrap {addr}"
                    self._lookup(addr, rec.dp_rank, source.tp_rank, now)
                    continue
                if (reason := self.handshakes.refused.get(entry.instance_id)) is not None:
                    self.fail(rec, ErrorCode.FAILED_PRECONDITION,
                              f"room {rec.room}: prefill rank {entry.instance_id} refused the handshake: "
                                   f"{reason}", now)
                    return
                peer = self.mgr.peers.get(entry.instance_id)
                if peer is not None and peer.key.epoch >= entry.epoch:
                    rank = (addr, rec.dp_rank, source.tp_rank)
                    silent_since = peer.last_seen + SUSPECT_HEARTBEATS * self.mgr.config.heartbeat_interval_s
                    if now > silent_since and self.looked_up.get(rank, 0.0) < silent_since:
                        rec.waiting_for = f"a fresh lookup of prefill rank {entry.instance_id}, silent for " \
                                          f"{now - peer.last_seen:.1f}s"
                        self._lookup(*rank, now)
                        continue
                    source.key = peer.key
                    continue
                rec.waiting_for = f"the handshake with prefill rank {entry.instance_id}"
                self.handshakes.hello(entry, now)
            if all(s.key is not None for s in rec.sources):
                rec.advance(KVPoll.WaitingForInput, now)
                rec.waiting_for = "send_metadata() from the decode scheduler"
                self._send_infos(rec)

    def _lookup(self, addr: str, dp_rank: int, tp_rank: int, now: float) -> None:
        key = (addr, dp_rank, tp_rank)
        if self.lookups.get(key, 0.0) > now:
            return
        self.lookups[key] = float("inf")
        self.mgr.run_in_background(self._fetch, key)

    def _fetch(self, key: tuple[str, int, int]) -> None:
        """Executor thread: one bootstrap lookup; the result is applied on the control thread."""
        addr, dp_rank, tp_rank = key
        client = self.mgr.bootstrap_client(addr)
        try:
            result: object = client.topology() if dp_rank < 0 else client.rank(dp_rank, tp_rank)
        except BootstrapError as exc:
            result = exc
        self.mgr.control.call_soon(lambda: self._apply_lookup(key, result))

    def _apply_lookup(self, key: tuple[str, int, int], result: object) -> None:
        now = time.monotonic()
        with self.mgr.lock:
            self.lookups[key] = now + LOOKUP_RETRY_S
            if isinstance(result, RankEntry):
                self.ranks[key], self.looked_up[key] = result, now
            elif isinstance(result, tuple):
                self.topology[key[0]] = result
            elif isinstance(result, BootstrapError) and result.code not in (
                    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                for rec in list(self.rooms.values()):
                    if rec.bootstrap_addr == key[0] and rec.state == KVPoll.Bootstrapping:
                        self.fail(rec, bootstrap_error_code(result), f"room {rec.room}: {result}", now)
        self._pump_all()


def bootstrap_error_code(error: BootstrapError) -> ErrorCode:
    """A room's code for a lookup the bootstrap refused: the lookup does not fit its topology or the cluster's
    secret (FAILED_PRECONDITION), else the rank is gone or unknown (UNAVAILABLE)."""
    if error.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                      grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return ErrorCode.FAILED_PRECONDITION
    return ErrorCode.UNAVAILABLE

