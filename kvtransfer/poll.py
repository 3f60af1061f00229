"""Transfer states of one request (a "room") and how they combine.

    Failed=0 < Bootstrapping=1 < WaitingForInput=2 < Transferring=3 < Success=4

Invariants: a room's state only moves up (``advance``); Failed is sticky and can be entered from any state except
Success; across TP ranks a request's state is the MIN of the ranks' states (``reduce_polls``), so any failed rank
fails the request and all ranks must succeed before it succeeds.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def is_final(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


def advance(current: KVPoll, new: KVPoll) -> KVPoll:
    """The state after asking ``current`` to become ``new``: never down, Failed sticky, Success final."""
    if current.is_final:
        return current
    if new == KVPoll.Failed:
        return KVPoll.Failed
    return max(current, new)


def reduce_polls(states: Iterable[KVPoll | int]) -> KVPoll:
    """MIN over ranks' states (what a TP group reports for one request). Empty input is an error."""
    states = [KVPoll(s) for s in states]
    if not states:
        raise ValueError("reduce_polls needs at least one state")
    return min(states)
