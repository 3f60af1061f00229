"""``KVHandle``: what the scheduler's per-request handles of both roles (``sender.KVSender``,
``receiver.KVReceiver``) share. Every method is non-blocking and runs on the scheduler thread.

Invariant: a handle only ever holds a record of its own manager's rooms, created by the role's constructor; the
record's ``state`` and ``quiesced`` are read without the lock (each a single attribute read that only moves forward).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from common.errors import ErrorCode
from kvtransfer.manager import KVManager, Rooms
from kvtransfer.poll import KVPoll
from kvtransfer.room_record import RoomRecord

RoomsT = TypeVar("RoomsT", bound=Rooms)


class KVHandle(Generic[RoomsT]):
    """The scheduler's handle on one request's transfer (``bootstrap_room``), over a ``rooms_class`` manager."""

    _rec: RoomRecord  # set by the role's constructor from its rooms' ``create``

    def __init__(self, mgr: KVManager, bootstrap_room: int, rooms_class: type[RoomsT]) -> None:
        if not isinstance(mgr.rooms, rooms_class):
            raise TypeError(f"{type(self).__name__} needs a {rooms_class.mode} KVManager; {mgr.instance_id} is "
                            f"{mgr.mode}")
        self._mgr = mgr
        self._rooms: RoomsT = mgr.rooms
        self.room = bootstrap_room

    def poll(self) -> KVPoll:
        """The room's state; cheap, never blocks."""
        return self._rec.state

    def failure(self) -> str:
        """Why the room failed (names the peer and the state), or "" if it has not."""
        return self._rec.reason

    def failure_code(self) -> ErrorCode | None:
        """The status the room failed with, set where the failure was detected; None if it has not failed."""
        return self._rec.code

    def abort(self, reason: str | None = None, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        """Fail the room with ``code`` here and on the peer side (which acks); pages stay owned until
        ``is_quiesced()``."""
        reason = f"aborted by the {self._rooms.mode} scheduler" if reason is None else reason
        self._rooms.abort(self._rec, code, f"room {self.room}: {reason}")

    def is_quiesced(self) -> bool:
        """True once no transfer touches this room's pages any more (prefill reads them, decode writes them): they
        may be freed or reused."""
        return self._rec.quiesced

    def clear(self) -> None:
        """Forget the room (after acting on a final poll); on decode this frees its metadata slot. Clearing an open
        room aborts it."""
        self._rooms.clear(self._rec)
