"""A failed KV room carries the ``ErrorCode`` its failure site set (in-process managers, fake data plane, 127.0.0.1):
a deadline is DEADLINE_EXCEEDED, a refused handshake FAILED_PRECONDITION, an abort CANCELLED, a silent peer
UNAVAILABLE, and the peer of a failed room takes the same code from the wire. Codes are read from the code field;
the reason's wording never decides one."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

import kvtransfer.node
from common.errors import ErrorCode
from kvtransfer.bootstrap import BootstrapServer
from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.manager import KVManager
from kvtransfer.poll import KVPoll
from kvtransfer.prefill_rooms import PrefillRooms
from kvtransfer.receiver import KVReceiver
from kvtransfer.room_record import RoomRecord
from kvtransfer.sender import KVSender
from kvtransfer.testing import (
    DECODE_SEED,
    PREFILL_SEED,
    TOKEN,
    kv_config,
    make_args,
    plan_rooms,
)

NUM_PAGES = 16
WAIT_S = 10.0


def _wait(predicate, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


class Pair:
    """A prefill and a decode manager on one Bootstrap service; ``start`` opens one room on both sides."""

    def __init__(self, prefill_overrides: dict[str, object], decode_overrides: dict[str, object]) -> None:
        self.server = BootstrapServer(TOKEN)
        self.addr = f"127.0.0.1:{self.server.start()}"
        self.prefill = KVManager(make_args(PREFILL_SEED, NUM_PAGES), kv_config("fake", **prefill_overrides),
                                 PrefillRooms, bootstrap_addr=self.addr)
        self.decode = KVManager(make_args(DECODE_SEED, NUM_PAGES), kv_config("fake", **decode_overrides),
                                DecodeRooms)

    def start(self, room_seed: int = 1) -> tuple[KVSender, KVReceiver]:
        plan = plan_rooms(1, NUM_PAGES, NUM_PAGES, pages_per_room=2, seed=room_seed)[0]
        sender = KVSender(self.prefill, plan.room)
        receiver = KVReceiver(self.decode, plan.room, self.addr)
        receiver.init(0)
        receiver.send_metadata(plan.dst_pages, plan.slot)
        return sender, receiver

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        self.server.stop()


@pytest.fixture
def make_pair() -> Iterator:
    pairs: list[Pair] = []

    def make(prefill: dict[str, object] | None = None, decode: dict[str, object] | None = None) -> Pair:
        pairs.append(Pair(prefill or {}, decode or {}))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()


def _failed(handle: KVSender | KVReceiver) -> tuple[ErrorCode | None, str]:
    _wait(lambda: handle.poll() == KVPoll.Failed and handle.is_quiesced(), f"room {handle.room} failed and quiesced")
    return handle.failure_code(), handle.failure()


def test_a_room_past_its_deadline_is_deadline_exceeded_on_both_sides(make_pair) -> None:
    pair = make_pair(prefill={"waiting_timeout_s": 0.3})
    sender, receiver = pair.start()
    _wait(lambda: sender.poll() == KVPoll.WaitingForInput, "the sender to get its TransferInfo")
    # The prefill scheduler never sends: its room expires, and decode hears the code in the Status.
    assert _failed(sender)[0] == ErrorCode.DEADLINE_EXCEEDED
    code, reason = _failed(receiver)
    assert code == ErrorCode.DEADLINE_EXCEEDED and "failed the room" in reason


def test_a_refused_handshake_is_failed_precondition(make_pair) -> None:
    pair = make_pair(decode={"fingerprint": {"architecture": "TinyLlama", "weights": "other"}})
    _, receiver = pair.start()
    code, reason = _failed(receiver)
    assert code == ErrorCode.FAILED_PRECONDITION and "refused the handshake" in reason


def test_an_abort_is_cancelled_here_and_on_the_peer(make_pair) -> None:
    pair = make_pair()
    sender, receiver = pair.start()
    _wait(lambda: sender.poll() == KVPoll.WaitingForInput, "the sender to get its TransferInfo")
    receiver.abort("client went away")
    assert _failed(receiver)[0] == ErrorCode.CANCELLED
    code, reason = _failed(sender)
    assert code == ErrorCode.CANCELLED and "aborted by decode" in reason


def test_a_cancelled_room_is_logged_at_info_and_a_failed_one_at_warning(make_pair, caplog) -> None:
    """A client's cancel fails rooms on both sides on every cancelled request: not a warning (a soak with client
    cancels drowned its log in them: benchmarks/pages/soak.md); a peer gone silent still is."""
    caplog.set_level(logging.INFO, logger="kvtransfer")
    sender, receiver = make_pair().start()
    _wait(lambda: sender.poll() == KVPoll.WaitingForInput, "the sender to get its TransferInfo")
    receiver.abort("client went away")
    assert _failed(receiver)[0] == ErrorCode.CANCELLED and _failed(sender)[0] == ErrorCode.CANCELLED
    fails = [(r.levelno, r.getMessage()) for r in caplog.records if "client went away" in r.getMessage()]
    assert len(fails) == 2 and {level for level, _ in fails} == {logging.INFO}, fails

    caplog.clear()
    fast = {"heartbeat_interval_s": 0.05, "heartbeat_misses": 4}
    pair = make_pair(prefill=fast, decode=fast)
    sender, receiver = pair.start()
    _wait(lambda: sender.poll() == KVPoll.WaitingForInput, "the sender to get its TransferInfo")
    pair.prefill.send_to = lambda key, msg: None
    assert _failed(receiver)[0] == ErrorCode.UNAVAILABLE
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "silent for" in r.getMessage()]


def test_a_silent_peer_is_unavailable(make_pair) -> None:
    fast = {"heartbeat_interval_s": 0.05, "heartbeat_misses": 4}
    pair = make_pair(prefill=fast, decode=fast)
    sender, receiver = pair.start()
    _wait(lambda: sender.poll() == KVPoll.WaitingForInput, "the sender to get its TransferInfo")
    pair.prefill.send_to = lambda key, msg: None  # the prefill rank hangs: no heartbeat, no room message
    code, reason = _failed(receiver)
    assert code == ErrorCode.UNAVAILABLE and "silent for" in reason


def test_the_reason_wording_does_not_decide_the_code(make_pair, monkeypatch) -> None:
    """An expiry reason worded like a refusal and an abort (what the removed word guessing read as
    FAILED_PRECONDITION) still fails the room with the deadline's code, on both sides."""
    assert not hasattr(kvtransfer.node, "transfer_error_code")
    monkeypatch.setattr(RoomRecord, "expiry_reason", lambda rec: f"room {rec.room}: aborted: cluster token mismatch")
    pair = make_pair(prefill={"waiting_timeout_s": 0.3})
    sender, receiver = pair.start()
    assert _failed(sender) == (ErrorCode.DEADLINE_EXCEEDED, f"room {sender.room}: aborted: cluster token mismatch")
    code, reason = _failed(receiver)
    assert code == ErrorCode.DEADLINE_EXCEEDED and reason.endswith("aborted: cluster token mismatch")
