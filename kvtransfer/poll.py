"""Transfer states of one request (a "room") and how they combine.

    Failed=0 < Bootstrapping=1 < WaitingForInput=2 < Transferring=3 < Success=4

Invariants: a room's state only moves up (``advance``); Failed is sticky and can be entered from any state except
Success; across TP ranks a request's state is the MIN of the ranks' states (``reduce_polls``), so any failed rank
fails the request and all ranks must succeed before it succeeds; a failed request's code is its lowest failed
rank's (``GroupPolls``), which the ranks it aborts adopt, so every rank reports one code.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from common.errors import ErrorCode


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


class KVHandleLike(Protocol):
    def poll(self) -> KVPoll: ...
    def is_quiesced(self) -> bool: ...
    def failure(self) -> str: ...
    def failure_code(self) -> ErrorCode | None: ...
    def abort(self, reason: str = ..., code: ErrorCode = ...) -> None: ...


@dataclass(frozen=True, slots=True)
class GroupPoll:
    """One request's transfer state as its whole TP group sees it."""

    state: KVPoll  # MIN over the group's ranks
    quiesced: bool  # every rank's handle is quiesced
    failed_rank: int | None  # the lowest TP rank whose own handle failed, when ``state`` is Failed
    code: ErrorCode | None = None  # ``failed_rank``'s failure code, when ``state`` is Failed


_UNSEEN = GroupPoll(KVPoll.Bootstrapping, False, None)
_CODES = tuple(ErrorCode)  # identical order on every rank: a code travels in the all-reduce as its index here


class GroupPolls:
    """The TP group's view of its requests' transfers (the seeds' all-reduce of ``KVPoll``), refreshed once a step.

    ``refresh`` runs ONE collective over every handle the scheduler may act on this step, in the scheduler's
    (identical) queue order: each rank contributes ``(state * tp_size + tp_rank) * len(ErrorCode) + code`` and
    ``quiesced``; the MIN gives the group's state, the lowest failed rank with its failure code, and whether all
    ranks are quiesced. A rank whose own handle is still open when the group failed aborts it with the group's
    code, so its pages quiesce too and a later refresh reports the same code. Decisions read the snapshot, so all ranks make
    them on the same values; a handle opened after the refresh reads as Bootstrapping until the next one.
    With ``tp_size == 1`` there is no snapshot: every read is the handle's own live state.
    """

    def __init__(self, all_reduce_min: Callable[[torch.Tensor], torch.Tensor], tp_rank: int, tp_size: int) -> None:
        self._all_reduce_min = all_reduce_min
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._seen: dict[int, tuple[KVHandleLike, GroupPoll]] = {}

    def refresh(self, handles: Sequence[KVHandleLike]) -> None:
        if self.tp_size == 1:
            return
        unique = list({id(h): h for h in handles}.values())
        self._seen = {}
        if not unique:
            return
        local = torch.tensor([[self._encode(h), int(h.is_quiesced())] for h in unique], dtype=torch.int64)
        reduced = self._all_reduce_min(local).tolist()
        for h, (packed, quiesced) in zip(unique, reduced, strict=True):
            state_rank, code_index = divmod(packed, len(_CODES))
            state, rank = KVPoll(state_rank // self.tp_size), state_rank % self.tp_size
            failed = state == KVPoll.Failed
            group = GroupPoll(state, bool(quiesced), rank if failed else None, _CODES[code_index] if failed else None)
            if failed and h.poll() != KVPoll.Failed:
                h.abort(f"KV transfer failed on TP rank {rank}", _CODES[code_index])
            self._seen[id(h)] = (h, group)

    def _encode(self, h: KVHandleLike) -> int:
        state = h.poll()
        # A failed handle always has a code; UNAVAILABLE stands in should a handle fail without one.
        code = (h.failure_code() or ErrorCode.UNAVAILABLE) if state == KVPoll.Failed else _CODES[0]
        return (int(state) * self.tp_size + self.tp_rank) * len(_CODES) + _CODES.index(code)

    def get(self, handle: KVHandleLike) -> GroupPoll:
        if self.tp_size == 1:
            state = handle.poll()
            if state != KVPoll.Failed:
                return GroupPoll(state, handle.is_quiesced(), None)
            return GroupPoll(state, handle.is_quiesced(), 0, handle.failure_code() or ErrorCode.UNAVAILABLE)
        entry = self._seen.get(id(handle))
        return entry[1] if entry is not None and entry[0] is handle else _UNSEEN

    def poll(self, handle: KVHandleLike) -> KVPoll:
        return self.get(handle).state

    def failure(self, handle: KVHandleLike) -> str:
        """Why the group failed the request: this rank's own reason, else which rank failed it."""
        return handle.failure() or f"KV transfer failed on TP rank {self.get(handle).failed_rank} (see its log)"

    def failure_code(self, handle: KVHandleLike) -> ErrorCode:
        """The status the group failed the request with (its lowest failed rank's code); call once Failed."""
        return self.get(handle).code or ErrorCode.UNAVAILABLE
