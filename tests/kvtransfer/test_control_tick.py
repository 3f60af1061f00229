"""The control thread's sweep runs on the short tick only while a room is open: an idle rank's control thread wakes
once per heartbeat (waking on the short tick cost every idle disaggregated rank CPU for nothing), and opening a room
brings the next sweep forward at once, so its deadlines and bootstrap retries keep their pace."""

from __future__ import annotations

import time

from common.errors import ErrorCode
from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.manager import KVManager
from kvtransfer.poll import KVPoll
from kvtransfer.receiver import KVReceiver
from kvtransfer.testing import DECODE_SEED, kv_config, make_args


def _wait(predicate, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.005)
    return time.monotonic() - start


def test_an_idle_rank_sweeps_once_per_heartbeat_and_an_open_room_at_once() -> None:
    config = kv_config("fake", heartbeat_interval_s=1.0, bootstrap_timeout_s=0.5, waiting_timeout_s=0.5)
    mgr = KVManager(make_args(DECODE_SEED, 16), config, DecodeRooms)
    ticks: list[float] = []
    sweep = mgr.rooms.tick

    def counted(now: float) -> bool:
        ticks.append(time.monotonic())
        return sweep(now)

    mgr.rooms.tick = counted  # type: ignore[method-assign]
    try:
        _wait(lambda: ticks, 2.0)
        time.sleep(1.5)
        assert len(ticks) <= 4, f"{len(ticks)} sweeps in ~1.5 s idle (the short tick makes ~75)"
        seen = len(ticks)
        _wait(lambda: len(ticks) > seen, 2.0)  # just after an idle sweep: the next one is ~1 s away
        opened = time.monotonic()
        rx = KVReceiver(mgr, 7, "127.0.0.1:1")  # nothing listens there: the room waits for its bootstrap
        _wait(lambda: ticks[-1] > opened, 2.0)
        assert ticks[-1] - opened < 0.2, "the first sweep after opening a room waited for the idle tick"
        _wait(lambda: rx.poll() == KVPoll.Failed, 3.0)
        assert rx.failure_code() == ErrorCode.DEADLINE_EXCEEDED
        assert time.monotonic() - opened < 0.5 + 0.5, "the room's deadline was swept late"
        fast = [t for t in ticks if t > opened]
        assert len(fast) >= 10, f"only {len(fast)} sweeps while the room was open"
        rx.clear()
    finally:
        mgr.close()
