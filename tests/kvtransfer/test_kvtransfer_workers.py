"""The per-peer worker threads every queued backend shares (``kvtransfer.backends.workers.PeerWorkers``), plain and
pipelined (a device backend's copies enqueued while the previous job lands)."""

from __future__ import annotations

import threading
import time

import pytest

from kvtransfer.backends.base import PeerKey, TransferJob
from kvtransfer.backends.workers import Landing, PeerWorkers, TransferError

PEER = PeerKey("decode-0", 1)
DEADLINE_S = 10.0


class Events:
    def __init__(self) -> None:
        self.done: list[tuple[int, str | None]] = []
        self.cond = threading.Condition()

    def on_job_done(self, job: TransferJob, error: str | None) -> None:
        with self.cond:
            self.done.append((job.room, error))
            self.cond.notify_all()

    def wait(self, count: int) -> list[tuple[int, str | None]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.done) >= count, DEADLINE_S), self.done
            return list(self.done)


def job(room: int) -> TransferJob:
    return TransferJob(room=room, chunk_id=0, peer=PEER, runs=())


class GatedCopies:
    """A device stand-in: ``move`` enqueues (records the room) and returns a landing that waits on the room's gate."""

    def __init__(self, fail_landing: set[int] = frozenset(), fail_move: set[int] = frozenset()) -> None:
        self.enqueued: list[int] = []
        self.gates: dict[int, threading.Event] = {}
        self.fail_landing, self.fail_move = fail_landing, fail_move
        self.stopped: list[tuple[PeerKey, list[int]]] = []
        self.enqueued_cond = threading.Condition()

    def move(self, job: TransferJob) -> Landing | None:
        if job.room in self.fail_move:
            raise TransferError(f"room {job.room} refused")
        gate = self.gates.setdefault(job.room, threading.Event())
        with self.enqueued_cond:
            self.enqueued.append(job.room)
            self.enqueued_cond.notify_all()

        def landing() -> None:
            assert gate.wait(DEADLINE_S)
            if job.room in self.fail_landing:
                raise TransferError(f"room {job.room} did not land")
        return landing

    def on_stop(self, key: PeerKey) -> None:
        self.stopped.append((key, [r for r, g in self.gates.items() if g.is_set()]))

    def wait_enqueued(self, count: int, timeout: float) -> bool:
        with self.enqueued_cond:
            return self.enqueued_cond.wait_for(lambda: len(self.enqueued) >= count, timeout)


@pytest.mark.parametrize("pipelined", [True, False])
def test_next_job_is_enqueued_while_the_previous_lands_only_when_pipelined(pipelined: bool) -> None:
    events, copies = Events(), GatedCopies()
    workers = PeerWorkers(events, copies.move, "shm", on_stop=copies.on_stop, pipelined=pipelined)
    workers.add_peer(PEER)
    for room in (1, 2, 3):
        workers.submit(job(room))
    # room 1's copy has not landed: a pipelined worker has enqueued every job's copies by now, a plain one only the first
    assert copies.wait_enqueued(3, 2.0 if pipelined else 0.5) is pipelined
    assert events.done == []  # nothing is reported before its bytes landed
    for room in (1, 2, 3):
        copies.gates.setdefault(room, threading.Event()).set()
    assert events.wait(3) == [(1, None), (2, None), (3, None)]  # reported in submission order
    workers.close("test over")


def test_pipelined_reports_failures_in_order_and_releases_the_peer_after_the_last_landing() -> None:
    events, copies = Events(), GatedCopies(fail_landing={2}, fail_move={3})
    workers = PeerWorkers(events, copies.move, "shm", on_stop=copies.on_stop, pipelined=True)
    workers.add_peer(PEER)
    for room in (1, 2, 3, 4):
        workers.submit(job(room))
    workers.cancel_room(5)
    workers.submit(job(5))
    assert copies.wait_enqueued(3, DEADLINE_S)  # 1, 2, 4 (3 refused, 5 cancelled)
    thread = workers.remove_peer(PEER, "peer removed")
    time.sleep(0.7)  # past the mover's drain period: the peer must still be held, room 4's copy is in flight
    assert copies.stopped == []
    for room in (1, 2, 4):
        copies.gates[room].set()
    done = events.wait(5)
    assert [room for room, _ in done] == [1, 2, 3, 4, 5]
    assert done[0] == (1, None) and done[3] == (4, None)
    assert "room 2 did not land" in str(done[1][1]) and "room 3 refused" in str(done[2][1])
    assert done[4] == (5, "cancelled")
    assert thread is not None
    thread.join(DEADLINE_S)  # the peer's worker ends only after its lander released the peer (what close waits for)
    assert copies.stopped == [(PEER, [1, 2, 4])]  # released once, after every landing


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_peer_added_again_while_its_old_worker_drains_keeps_its_resources(pipelined: bool) -> None:
    """A peer that lost this rank handshakes again: removed, then added at once. The key's resources (a backend's
    mapping of the peer's pool) belong to the new worker: the old one's end must not release them (it did, and every
    later job to that peer failed "not mapped: peer removed"); the last worker of the key to end releases them once."""
    events, copies = Events(), GatedCopies()
    workers = PeerWorkers(events, copies.move, "shm", on_stop=copies.on_stop, pipelined=pipelined)
    workers.add_peer(PEER)
    workers.submit(job(1))
    copies.gates.setdefault(1, threading.Event()).set()
    assert events.wait(1) == [(1, None)]
    old = workers.remove_peer(PEER, "peer removed")
    workers.add_peer(PEER)  # the same key again, before the old worker's drain period ended
    assert old is not None
    old.join(DEADLINE_S)
    assert copies.stopped == []  # the new worker holds the key: nothing released
    workers.submit(job(2))
    copies.gates.setdefault(2, threading.Event()).set()
    assert events.wait(2) == [(1, None), (2, None)]
    new = workers.remove_peer(PEER, "peer removed")
    assert new is not None
    new.join(DEADLINE_S)
    assert [key for key, _ in copies.stopped] == [PEER]  # released once, by the last worker of the key
