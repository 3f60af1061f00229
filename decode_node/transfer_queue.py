"""``DecodeTransferQueue``: requests whose pages are allocated and whose KV is arriving.

Invariant: pages of a failed or aborted transfer are freed only once the receiver is quiesced (nothing can
write into them any more), so a late chunk can never land in pages that another request reuses. Both tests are
the TP group's (``GroupPolls``): a request joins the running batch only when every rank's KV arrived.
"""

from __future__ import annotations

from common.engine.req import Req
from kvtransfer.poll import GroupPolls, KVPoll


class DecodeTransferQueue:
    def __init__(self, polls: GroupPolls) -> None:
        self.polls = polls
        self.queue: list[Req] = []

    def __len__(self) -> int:
        return len(self.queue)

    def extend(self, reqs: list[Req]) -> None:
        self.queue.extend(reqs)

    def pop_transferred(self) -> tuple[list[Req], list[Req]]:
        """(requests whose KV arrived, requests that failed and are quiesced)."""
        done, failed, keep = [], [], []
        for req in self.queue:
            group = self.polls.get(req.disagg_kv)
            if group.state == KVPoll.Success and req.to_abort is None:
                done.append(req)
            elif group.state.is_final and group.quiesced:
                failed.append(req)
            else:
                keep.append(req)
        self.queue = keep
        return done, failed

    def find(self, rid: str) -> Req | None:
        return next((r for r in self.queue if r.rid == rid), None)
