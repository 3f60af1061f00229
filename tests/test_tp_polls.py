"""The TP group's view of a transfer is the MIN over its ranks (``GroupPolls``, a real gloo all-reduce between two
spawned processes): one rank held in Transferring keeps the request out of decode's running batch on every rank
until it succeeds, and one rank failing fails the request on all ranks (the others abort their own handle, taking
the failed rank's code, so every rank reports the same one)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from common.engine.distributed import TPGroup
from common.errors import ErrorCode
from kvtransfer.poll import GroupPolls, KVPoll
from tests.tp_helpers import run_ranks

pytestmark = pytest.mark.slow  # spawns rank processes


class FakeHandle:
    """A KVReceiver stand-in whose state the test sets per rank."""

    def __init__(self, state: KVPoll, quiesced: bool = False, reason: str = "",
                 code: ErrorCode | None = None) -> None:
        self.state, self.quiesced, self.reason, self.code = state, quiesced, reason, code
        self.aborted: str | None = None

    def poll(self) -> KVPoll:
        return self.state

    def is_quiesced(self) -> bool:
        return self.quiesced

    def failure(self) -> str:
        return self.reason

    def failure_code(self) -> ErrorCode | None:
        return self.code

    def abort(self, reason: str = "", code: ErrorCode = ErrorCode.CANCELLED) -> None:
        self.aborted = reason
        self.state, self.reason, self.code = KVPoll.Failed, f"room 1: {reason}", code


class FakeReq:
    def __init__(self, rid: str, handle: FakeHandle) -> None:
        self.rid, self.disagg_kv, self.to_abort = rid, handle, None


def _rank(tp: TPGroup) -> tuple[list[dict[str, Any]], str | None]:
    from decode_node.transfer_queue import DecodeTransferQueue

    tp_rank = tp.tp_rank
    polls = GroupPolls(tp.all_reduce_min, tp.tp_rank, tp.tp_size)
    transfers = DecodeTransferQueue(polls)
    held = FakeReq("held", FakeHandle(KVPoll.Transferring if tp_rank == 1 else KVPoll.Success, quiesced=True))
    failing = FakeReq("failing", FakeHandle(KVPoll.Failed if tp_rank == 1 else KVPoll.Transferring,
                                            quiesced=tp_rank == 1, reason="room 1: decode peer lost" * (tp_rank == 1),
                                            code=ErrorCode.DEADLINE_EXCEEDED if tp_rank == 1 else None))
    transfers.extend([held, failing])  # type: ignore[list-item]
    steps = []
    for step in range(3):
        if step == 1 and tp_rank == 1:
            held.disagg_kv.state = KVPoll.Success  # the held rank's KV arrives
        if step == 2 and tp_rank == 0:
            failing.disagg_kv.quiesced = True  # the aborted handle drained
        polls.refresh([r.disagg_kv for r in transfers.queue])
        views = {r.rid: polls.get(r.disagg_kv) for r in transfers.queue}
        done, failed = transfers.pop_transferred()
        steps.append({
            "views": {rid: (int(v.state), v.quiesced, v.failed_rank, v.code) for rid, v in views.items()},
            "done": [r.rid for r in done], "failed": [r.rid for r in failed],
            "failure": polls.failure(failing.disagg_kv),
            "code": polls.failure_code(failing.disagg_kv),
            "own_code": failing.disagg_kv.failure_code(),
        })
    return steps, failing.disagg_kv.aborted


def test_group_state_is_the_min_over_tp_ranks() -> None:
    (steps0, aborted0), (steps1, aborted1) = run_ranks(_rank, 2)
    for steps in (steps0, steps1):
        # Step 0: rank 1 still Transferring holds "held" out of the running batch on BOTH ranks; rank 1's Failed
        # fails "failing" everywhere, but rank 0's handle is not yet quiesced, so its pages stay put.
        assert steps[0]["views"]["held"] == (int(KVPoll.Transferring), True, None, None)
        assert steps[0]["views"]["failing"] == (int(KVPoll.Failed), False, 1, ErrorCode.DEADLINE_EXCEEDED)
        # Every step, both ranks report rank 1's code, not CANCELLED from rank 0's own (group) abort.
        assert [s["code"] for s in steps] == [ErrorCode.DEADLINE_EXCEEDED] * 3
        assert [s["own_code"] for s in steps] == [ErrorCode.DEADLINE_EXCEEDED] * 3
        assert steps[0]["done"] == [] and steps[0]["failed"] == []
        # Step 1: rank 1's KV arrived: "held" joins the running batch on both ranks in the same step.
        assert steps[1]["done"] == ["held"] and steps[1]["failed"] == []
        # Step 2: every rank quiesced: "failing" leaves the transfer queue on both ranks.
        assert steps[2]["failed"] == ["failing"]
    assert aborted0 == "KV transfer failed on TP rank 1" and aborted1 is None
    assert steps1[0]["failure"] == "room 1: decode peer lost"
    assert steps0[0]["failure"] == "room 1: KV transfer failed on TP rank 1"


def test_tp1_reads_the_live_state_without_a_collective() -> None:
    def no_collective(t: torch.Tensor) -> torch.Tensor:
        raise AssertionError("tp 1 must not run a collective")

    polls = GroupPolls(no_collective, 0, 1)
    handle = FakeHandle(KVPoll.WaitingForInput)
    polls.refresh([handle])
    assert polls.poll(handle) == KVPoll.WaitingForInput
    handle.state = KVPoll.Success
    assert polls.poll(handle) == KVPoll.Success
    # A failed handle's code is what the group reports, whatever its reason's wording says.
    failed = FakeHandle(KVPoll.Failed, reason="room 2: deadline passed, aborted: cluster token mismatch",
                        code=ErrorCode.UNAVAILABLE)
    assert polls.get(failed).code == polls.failure_code(failed) == ErrorCode.UNAVAILABLE
