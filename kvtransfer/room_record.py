"""Per-room records shared by both sides: state, failure code and reason, deadline, quiescence. The role's room logic
that ``KVManager`` drives (``Rooms``) is declared beside the manager.

Invariants: ``state`` only moves through ``poll.advance`` (up; Failed sticky); every non-final state has a
``deadline`` (set on entering it, pushed out on progress); ``quiesced`` becomes True once no peer can still write
to (decode) or read from (prefill) this room's pages, and never goes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import ErrorCode
from kvtransfer.args import KVTransferConfig
from kvtransfer.backends.base import PeerKey
from kvtransfer.poll import KVPoll, advance


def state_timeout(config: KVTransferConfig, state: KVPoll) -> float:
    return {KVPoll.Bootstrapping: config.bootstrap_timeout_s, KVPoll.WaitingForInput: config.waiting_timeout_s,
            KVPoll.Transferring: config.transfer_timeout_s}.get(state, 0.0)


@dataclass
class RoomRecord:
    room: int
    config: KVTransferConfig
    now: float
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    code: ErrorCode | None = None  # set with ``reason`` by the failure, by the code that detected it
    deadline: float = 0.0
    quiesced: bool = False
    finished_at: float = 0.0
    waiting_for: str = "the peer"  # named in a deadline failure
    unacked: set[PeerKey] = field(default_factory=set)  # peers that may still touch the pages
    ack_deadline: float = 0.0

    def __post_init__(self) -> None:
        self.deadline = self.now + state_timeout(self.config, self.state)

    def advance(self, new: KVPoll, now: float) -> bool:
        """Move up to ``new`` (no-op if not higher); True if the state changed."""
        after = advance(self.state, new)
        if after == self.state:
            return False
        self.state = after
        self.deadline = now + state_timeout(self.config, after)
        if after == KVPoll.Success:
            self.finished_at, self.quiesced = now, True
        return True

    def progress(self, now: float) -> None:
        """Progress in the current state pushes its deadline out (Transferring is a no-progress deadline)."""
        if not self.state.is_final:
            self.deadline = now + state_timeout(self.config, self.state)

    def fail(self, code: ErrorCode, reason: str, now: float) -> bool:
        """Failed with ``code`` and ``reason``; True if this call failed it (the first failure's are kept)."""
        if self.state.is_final:
            return False
        self.state, self.code, self.reason, self.finished_at = KVPoll.Failed, code, reason, now
        self.ack_deadline = now + self.config.abort_ack_timeout_s
        return True

    def expired(self, now: float) -> bool:
        return not self.state.is_final and now > self.deadline

    def expiry_reason(self) -> str:
        return (f"room {self.room}: deadline of {state_timeout(self.config, self.state):.1f}s passed in "
                f"{self.state.name} waiting for {self.waiting_for}")

    def peer_quiesced(self, key: PeerKey) -> None:
        self.unacked.discard(key)
        if self.state.is_final and not self.unacked:
            self.quiesced = True
