"""``PrefillInflightQueue``: prefilled requests whose KV is still moving to the decode node.

Invariant: a request's pages stay locked here until its KVSender is final *and* quiesced (no transfer reads
them any more) on every TP rank of the group; only then are they released into the radix cache.
"""

from __future__ import annotations

from common.engine.req import Req
from kvtransfer.poll import GroupPolls, KVPoll


class PrefillInflightQueue:
    def __init__(self, polls: GroupPolls) -> None:
        self.polls = polls
        self.queue: list[Req] = []

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, req: Req) -> None:
        self.queue.append(req)

    def pop_done(self) -> list[tuple[Req, KVPoll]]:
        """Requests whose transfer is final and quiesced, with their final state."""
        done, keep = [], []
        for req in self.queue:
            group = self.polls.get(req.disagg_kv)
            if group.state.is_final and group.quiesced:
                done.append((req, group.state))
            else:
                keep.append(req)
        self.queue = keep
        return done

    def find(self, rid: str) -> Req | None:
        return next((r for r in self.queue if r.rid == rid), None)
