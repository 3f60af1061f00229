"""Prefill side: ``PrefillRooms``, the manager's room logic (a ``manager.Rooms``) behind each ``sender.KVSender``,
and its per-room record ``SendRoom``.

Chunk k of a room becomes one ``TransferJob`` per destination decode rank: this chunk's source pages paired with
``dst_pages[pages_sent : pages_sent + len(chunk)]`` of that rank's TransferInfo, coalesced into runs. Pairs whose
destination is page 0 (the padding page, never allocated) are dropped: the decode rank holds those pages already
(a prompt it shares). A chunk left with no pair for any rank is not sent (no job, no ChunkDone: chunks are counted
on both sides as sent), unless it is the last one, which carries the metadata as an empty job.
Invariant: ``outstanding`` counts submitted jobs not yet done; the room is quiesced (its pages may be freed)
once it is final and ``outstanding == 0``; a failed room tells its decode peers only then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from common.errors import ErrorCode
from kvtransfer import auth
from kvtransfer.args import Mode, incompatibility
from kvtransfer.backends.base import PeerKey, TransferJob
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
from kvtransfer.pages import (
    HeadSlice,
    coalesce_runs,
    dst_ranks_served,
    head_slice_for,
    is_whole_page,
    pages_outside,
    source_plan,
    unheld_pairs,
)
from kvtransfer.poll import KVPoll
from kvtransfer.room_record import RoomRecord

if TYPE_CHECKING:
    from kvtransfer.manager import KVManager, Peer

log = logging.getLogger(__name__)

MAX_CHALLENGES = 1024  # open handshakes kept per prefill rank; a flood of Hellos evicts the oldest


@dataclass
class DecodeTarget:
    """One decode rank a room's KV goes to."""

    key: PeerKey
    info: TransferInfo
    heads: HeadSlice | None  # None: whole pages
    writes_metadata: bool  # this prefill rank is the one that delivers the metadata record to that rank
    final_sent: bool = False
    confirmed: bool = False  # the decode rank reported Success (it has every chunk and a valid metadata record)
    signals: bool = False  # it reads our landing signals: a job's ChunkDone leaves once its copy is enqueued
    announced: set[int] = field(default_factory=set)  # chunks whose ChunkDone left before their job was done


@dataclass
class SendRoom(RoomRecord):
    targets: dict[PeerKey, DecodeTarget] = field(default_factory=dict)
    required: int = 0  # decode ranks to wait for (known from the first TransferInfo)
    num_pages: int | None = None
    metadata_slot: int | None = None
    pages_sent: int = 0
    next_chunk: int = 0
    outstanding: int = 0
    last_submitted: bool = False
    metadata: MetadataRecord | None = None
    abort_from: PeerKey | None = None  # the decode peer whose Abort we must ack
    notify: type[Status] | type[Abort] = Status  # how the other decode peers hear of a failure


class PrefillRooms:
    mode: ClassVar[Mode] = "prefill"

    def __init__(self, mgr: KVManager) -> None:
        self.mgr = mgr
        self.rooms: dict[int, SendRoom] = {}
        self.early: dict[int, tuple[float, list[tuple[Peer, TransferInfo]]]] = {}  # TransferInfo before the sender
        # failed room -> (forget at, failure reason, failure code)
        self.tombstones: dict[int, tuple[float, str, ErrorCode]] = {}
        # (decode instance_id, epoch) -> (expires, its Hello, our nonce): challenges awaiting a HelloProof
        self.challenges: dict[tuple[str, int], tuple[float, Hello, bytes]] = {}

    # ---- scheduler thread -------------------------------------------------------------------------------------
    def create(self, room: int) -> SendRoom:
        now = time.monotonic()
        with self.mgr.lock:
            rec = SendRoom(room, self.mgr.config, now, waiting_for="the decode side's TransferInfo")
            if room in self.rooms:
                rec.fail(ErrorCode.UNAVAILABLE, f"room {room}: duplicate bootstrap room (already in flight on this prefill rank)", now)
                rec.quiesced = True
                return rec
            self.rooms[room] = rec
            _, reason, code = self.tombstones.pop(room, (0.0, "", ErrorCode.UNAVAILABLE))
            if reason:
                rec.fail(code, reason, now)
                rec.quiesced = True
            for peer, info in self.early.pop(room, (0.0, []))[1]:
                self._add_info(rec, peer, info, now)
        self.mgr.control.tick_soon()  # its deadline needs the short tick
        return rec

    def init(self, rec: SendRoom, num_pages: int, metadata_slot: int | None) -> None:
        with self.mgr.lock:
            rec.num_pages, rec.metadata_slot = num_pages, metadata_slot
            self._check_page_counts(rec, time.monotonic())

    def send(self, rec: SendRoom, pages: Sequence[int], last: bool, metadata: MetadataRecord | None) -> None:
        if last and (metadata is None or metadata.room != rec.room):
            raise ValueError(f"room {rec.room}: the last send() needs a MetadataRecord for this room, got {metadata}")
        bad = pages_outside(pages, self.mgr.args.num_pages)
        if bad:
            raise ValueError(f"room {rec.room}: page numbers {bad[:5]} outside [1, {self.mgr.args.num_pages})")
        now = time.monotonic()
        with self.mgr.lock:
            if rec.state.is_final:
                return
            if rec.state < KVPoll.WaitingForInput or rec.last_submitted:
                self.fail(rec, ErrorCode.INTERNAL, f"room {rec.room}: send() in state {rec.state.name}"
                               f"{' after the last chunk' if rec.last_submitted else ''}", now)
                return
            start, stop = rec.pages_sent, rec.pages_sent + len(pages)
            jobs = []
            for target in rec.targets.values():
                dst = target.info.dst_pages
                if stop > len(dst):
                    self.fail(rec, ErrorCode.FAILED_PRECONDITION, f"room {rec.room}: prefill sent {stop} pages but decode {target.key.instance_id} "
                                   f"allocated {len(dst)}", now)
                    return
                runs = tuple(coalesce_runs(*unheld_pairs(pages, dst[start:stop])))
                jobs.append(TransferJob(rec.room, rec.next_chunk, target.key, runs, target.heads, target.signals))
            rec.pages_sent = stop
            rec.advance(KVPoll.Transferring, now)
            rec.progress(now)
            if not last and not any(job.runs for job in jobs):
                return  # every page of the chunk is held on decode already
            rec.next_chunk += 1
            rec.last_submitted, rec.metadata = last, metadata
            rec.outstanding += len(jobs)
            rec.waiting_for = "the data plane to deliver the chunks"
            for job in jobs:
                self.mgr.backend.submit(job)

    def abort(self, rec: SendRoom, code: ErrorCode, reason: str) -> None:
        with self.mgr.lock:
            self.fail(rec, code, reason, time.monotonic(), notify=Abort)

    def clear(self, rec: SendRoom) -> None:
        with self.mgr.lock:
            if self.rooms.get(rec.room) is rec:
                if not rec.state.is_final:
                    self.fail(rec, ErrorCode.CANCELLED, f"room {rec.room}: cleared while {rec.state.name}",
                              time.monotonic(), notify=Abort)
                if rec.quiesced:
                    del self.rooms[rec.room]

    # ---- control thread ---------------------------------------------------------------------------------------
    def handshake(self, msg: Hello | HelloChallenge | HelloProof | HelloAck, frames: list[bytes]) -> None:
        """Answer a Hello with a challenge; accept the decode rank once its proof of the secret checks out."""
        now = time.monotonic()
        if isinstance(msg, Hello):
            nonce = auth.new_nonce()
            t = auth.transcript(msg.instance_id, msg.epoch, msg.nonce, self.mgr.instance_id, self.mgr.epoch, nonce)
            with self.mgr.lock:
                self._prune_challenges(now)
                self.challenges[(msg.instance_id, msg.epoch)] = (now + self.mgr.config.bootstrap_timeout_s, msg, nonce)
            self.mgr.control.send(msg.control_addr, HelloChallenge(
                **self.mgr.stamp(), hello_nonce=msg.nonce, nonce=nonce,
                proof=auth.proof(self.mgr.config.cluster_token, "prefill", t)))
            return
        if not isinstance(msg, HelloProof):
            return
        with self.mgr.lock:
            _, hello, nonce = self.challenges.pop((msg.instance_id, msg.epoch), (0.0, None, b""))
        if hello is None:
            self.mgr.auth_drops.add("unknown_handshake")
            return
        secret = self.mgr.config.cluster_token
        t = auth.transcript(hello.instance_id, hello.epoch, hello.nonce, self.mgr.instance_id, self.mgr.epoch, nonce)
        if not auth.check_proof(secret, "decode", t, msg.proof):
            self.mgr.auth_drops.add("bad_proof")
            reason = "cluster token mismatch: the decode rank could not prove this cluster's secret"
            log.warning("kv %s: refused %s: %s", self.mgr.instance_id, hello.instance_id, reason)
            self.mgr.control.send(hello.control_addr, HelloAck(**self.mgr.stamp(), accepted=False, reason=reason,
                                                               hello_nonce=hello.nonce))
            return
        session = auth.session_key(secret, t)
        key = PeerKey(hello.instance_id, hello.epoch)
        if reason := incompatibility(self.mgr.layout, hello.layout):
            log.warning("kv %s: refused %s: %s", self.mgr.instance_id, hello.instance_id, reason)
            self.mgr.control.send(hello.control_addr, HelloAck(**self.mgr.stamp(), accepted=False, reason=reason),
                                  (session, 1))
            return
        known = self.mgr.peers.get(hello.instance_id)
        if known is not None and known.key.epoch > hello.epoch:
            return  # a Hello from a start older than the one we accepted
        self.mgr.accept_peer(key, hello.control_addr, hello.layout, hello.endpoint, session)
        self.mgr.send_to(key, HelloAck(**self.mgr.stamp(), accepted=True, layout=self.mgr.layout,
                                       endpoint={**self.mgr.endpoint, **self.mgr.backend.peer_endpoint(key)}))

    def _prune_challenges(self, now: float) -> None:
        """Bound the open challenges: expired ones go, and at most MAX_CHALLENGES stay (oldest evicted)."""
        for k, (expires, _, _) in list(self.challenges.items()):
            if now > expires:
                del self.challenges[k]
        while len(self.challenges) >= MAX_CHALLENGES:
            del self.challenges[next(iter(self.challenges))]

    def handle(self, msg: AnyMessage, peer: Peer) -> None:
        now = time.monotonic()
        with self.mgr.lock:
            rec = self.rooms.get(getattr(msg, "room", -1))
            if isinstance(msg, TransferInfo):
                if rec is not None:
                    self._add_info(rec, peer, msg, now)
                elif msg.room in self.tombstones:
                    _, reason, code = self.tombstones[msg.room]
                    self.mgr.send_to(peer.key, Status(**self.mgr.stamp(), room=msg.room, state=KVPoll.Failed,
                                                      reason=reason or "room already finished", code=code))
                else:
                    expires, infos = self.early.get(msg.room, (now + self.mgr.config.bootstrap_timeout_s, []))
                    self.early[msg.room] = (expires, [*infos, (peer, msg)])
            elif isinstance(msg, Abort):
                reason = f"room {msg.room}: aborted by decode {peer.describe()}: {msg.reason}"
                if rec is None or rec.quiesced:
                    self.early.pop(msg.room, None)
                    self.tombstones.setdefault(msg.room, (now + self.mgr.config.tombstone_s, reason, msg.code))
                    self.mgr.send_to(peer.key, AbortAck(**self.mgr.stamp(), room=msg.room))
                else:
                    rec.abort_from = peer.key
                    if not self.fail(rec, msg.code, reason, now) and rec.quiesced:
                        self.mgr.send_to(peer.key, AbortAck(**self.mgr.stamp(), room=msg.room))
            elif isinstance(msg, Status) and msg.state == KVPoll.Success:
                for room in (msg.room, *msg.rooms):
                    self._confirmed(self.rooms.get(room), peer, now)
            # AbortAck from decode: nothing of ours is in flight any more; the room is already quiesced.

    def _confirmed(self, rec: SendRoom | None, peer: Peer, now: float) -> None:
        """``peer`` has every chunk of ``rec`` and its record; the room succeeds once every target has and every
        job of it is done here too (a signalled job's report may come after the decode side saw it land)."""
        target = None if rec is None else rec.targets.get(peer.key)
        if rec is not None and target is not None and target.final_sent:
            target.confirmed = True
            if rec.outstanding == 0 and all(t.confirmed for t in rec.targets.values()):
                rec.advance(KVPoll.Success, now)

    def flush(self) -> None:
        """Nothing is batched on this side."""

    def job_done(self, job: TransferJob, error: str | None) -> None:
        now = time.monotonic()
        with self.mgr.lock:
            rec = self.rooms.get(job.room)
            if rec is None:
                return
            rec.outstanding -= 1
            target = rec.targets.get(job.peer)
            if error is not None:
                self.fail(rec, ErrorCode.UNAVAILABLE,
                          f"room {job.room}: chunk {job.chunk_id} to {job.peer.instance_id} failed: {error}", now)
            elif not rec.state.is_final and target is not None:
                if job.chunk_id in target.announced:
                    target.announced.discard(job.chunk_id)
                    if rec.outstanding == 0 and all(t.confirmed for t in rec.targets.values()):
                        rec.advance(KVPoll.Success, now)
                else:
                    self._chunk_done(rec, job, target, 0, now)
            self._maybe_drained(rec)

    def job_enqueued(self, job: TransferJob, signal: int) -> None:
        """The job's copy is enqueued with landing signal ``signal``: its ChunkDone leaves now (decode waits for the
        signal); ``job_done`` still follows once it landed here."""
        with self.mgr.lock:
            rec = self.rooms.get(job.room)
            target = None if rec is None else rec.targets.get(job.peer)
            if rec is not None and target is not None and not rec.state.is_final:
                target.announced.add(job.chunk_id)
                self._chunk_done(rec, job, target, signal, time.monotonic())

    def _chunk_done(self, rec: SendRoom, job: TransferJob, target: DecodeTarget, signal: int, now: float) -> None:
        final = rec.last_submitted and job.chunk_id == rec.next_chunk - 1
        self.mgr.send_to(job.peer, ChunkDone(
            **self.mgr.stamp(), room=job.room, chunk_id=job.chunk_id, num_pages=job.num_pages,
            num_chunks=rec.next_chunk if final else 0,
            metadata=rec.metadata if final and target.writes_metadata else None, signal=signal))
        target.final_sent = final
        rec.progress(now)
        if final:
            rec.waiting_for = "the decode side to confirm the last chunk"

    def peer_lost(self, key: PeerKey, reason: str) -> None:
        now = time.monotonic()
        with self.mgr.lock:
            for rec in list(self.rooms.values()):
                if key in rec.targets:
                    self.fail(rec, ErrorCode.UNAVAILABLE, f"room {rec.room}: {reason} while {rec.state.name}", now)
            for room, (expires, infos) in list(self.early.items()):
                self.early[room] = (expires, [(p, i) for p, i in infos if p.key != key])

    def tick(self, now: float) -> bool:
        with self.mgr.lock:
            busy = bool(self.early)
            for rec in list(self.rooms.values()):
                if rec.expired(now):
                    self.fail(rec, ErrorCode.DEADLINE_EXCEEDED, rec.expiry_reason(), now)
                elif rec.state.is_final and rec.quiesced and now - rec.finished_at > self.mgr.config.tombstone_s:
                    del self.rooms[rec.room]  # never cleared by the scheduler; bound the table
                busy = busy or not (rec.state.is_final and rec.quiesced)
            for room, (expires, infos) in list(self.early.items()):
                if now > expires:
                    del self.early[room]
                    for peer, _ in infos:
                        self.mgr.send_to(peer.key, Status(**self.mgr.stamp(), room=room, state=KVPoll.Failed,
                                                          code=ErrorCode.UNAVAILABLE, reason=(
                            f"room {room}: no prefill request for it arrived within "
                            f"{self.mgr.config.bootstrap_timeout_s:.1f}s on {self.mgr.instance_id}")))
            for room, (expires, _, _) in list(self.tombstones.items()):
                if now > expires:
                    del self.tombstones[room]
            return busy

    def close(self, reason: str) -> None:
        with self.mgr.lock:
            for rec in self.rooms.values():
                self.fail(rec, ErrorCode.UNAVAILABLE, reason, time.monotonic())

    # ---- internals (lock held) --------------------------------------------------------------------------------
    def fail(self, rec: SendRoom, code: ErrorCode, reason: str, now: float,
             notify: type[Status] | type[Abort] | None = Status) -> bool:
        """Fail the room, stop its queued jobs; its decode peers hear of it (with ``code``) once nothing is in flight."""
        if not rec.fail(code, reason, now):
            return False
        log.log(code.log_level, "kv %s: %s", self.mgr.instance_id, reason)
        self.tombstones[rec.room] = (now + self.mgr.config.tombstone_s, reason, code)
        rec.waiting_for = "in-flight jobs to drain"
        rec.notify = notify or Status
        rec.unacked = set(rec.targets) if notify is not None else set()
        self.mgr.backend.cancel_room(rec.room)
        self._maybe_drained(rec)
        return True

    def _maybe_drained(self, rec: SendRoom) -> None:
        if not rec.state.is_final or rec.outstanding > 0 or rec.quiesced:
            return
        rec.quiesced = True
        if rec.state == KVPoll.Failed:
            code = rec.code or ErrorCode.UNAVAILABLE
            for key in rec.unacked:
                if key == rec.abort_from:
                    self.mgr.send_to(key, AbortAck(**self.mgr.stamp(), room=rec.room))
                elif rec.notify is Abort:
                    self.mgr.send_to(key, Abort(**self.mgr.stamp(), room=rec.room, reason=rec.reason, code=code))
                else:
                    self.mgr.send_to(key, Status(**self.mgr.stamp(), room=rec.room, state=KVPoll.Failed,
                                                 reason=rec.reason, code=code))
            rec.unacked = set()

    def _add_info(self, rec: SendRoom, peer: Peer, info: TransferInfo, now: float) -> None:
        if rec.state != KVPoll.Bootstrapping or peer.key in rec.targets:
            return
        me, dst = self.mgr.layout, peer.layout
        heads = head_slice_for(me.tp_rank, me.tp_size, dst.tp_rank, dst.tp_size, me.total_kv_heads)
        if heads is None:
            self.fail(rec, ErrorCode.FAILED_PRECONDITION, f"room {rec.room}: decode rank {peer.describe()} takes no KV heads from prefill tp rank "
                           f"{me.tp_rank}/{me.tp_size}", now)
            return
        writer = source_plan(dst.tp_rank, dst.tp_size, me.tp_size, me.total_kv_heads)[0][0] == me.tp_rank
        whole = is_whole_page(heads, me.kv_heads, dst.kv_heads)
        rec.targets[peer.key] = DecodeTarget(peer.key, info, None if whole else heads, writer, signals=info.landing_signals)
        rec.required = len(dst_ranks_served(me.tp_rank, me.tp_size, dst.tp_size, me.total_kv_heads))
        if len(rec.targets) >= rec.required:
            rec.advance(KVPoll.WaitingForInput, now)
            rec.waiting_for = "the prefill scheduler to send the first chunk"
            self._check_page_counts(rec, now)

    def _check_page_counts(self, rec: SendRoom, now: float) -> None:
        if rec.num_pages is None:
            return
        for target in rec.targets.values():
            if len(target.info.dst_pages) != rec.num_pages:
                self.fail(rec, ErrorCode.FAILED_PRECONDITION, f"room {rec.room}: page count mismatch: prefill={rec.num_pages} "
                               f"decode={len(target.info.dst_pages)} ({target.key.instance_id})", now)
                return

