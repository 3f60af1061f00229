"""``PrefillBootstrapQueue``: requests whose decode side has not yet sent its destination pages."""

from __future__ import annotations

import time

import msgspec

from common.engine.io_struct import GenerateReqInput
from common.engine.mem.pages import num_pages
from common.engine.req import Req
from common.engine.scheduler_role import Engine
from common.errors import ErrorCode
from kvtransfer.manager import KVManager
from kvtransfer.poll import GroupPolls, KVPoll
from kvtransfer.sender import KVSender


class PrefillBootstrapQueue:
    def __init__(self, engine: Engine, kv_manager: KVManager, polls: GroupPolls) -> None:
        self.engine = engine
        self.kv_manager = kv_manager
        self.polls = polls
        self.queue: list[Req] = []

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, msg: GenerateReqInput) -> Req | None:
        """Validate (capacity, sampling), cap generation at the first token, open the request's KVSender."""
        if msg.bootstrap_room is None:
            self.engine.out.error(msg.rid, "bootstrap_room is required on a prefill node", ErrorCode.INVALID_ARGUMENT)
            return None
        # Prefill samples only the first token; capacity is checked for the prompt alone. min_new_tokens stays
        # (capped at 1) so EOS and stop ids are masked on the first token exactly as on a colocated node.
        sp = msg.sampling_params
        msg = msgspec.structs.replace(
            msg, sampling_params=msgspec.structs.replace(sp, max_new_tokens=1, min_new_tokens=min(sp.min_new_tokens, 1))
        )
        req = self.engine.intake.build_req(msg)
        if req is None:
            return None
        req.disagg_kv = KVSender(self.kv_manager, msg.bootstrap_room)
        self.queue.append(req)
        return req

    def pop_bootstrapped(self) -> tuple[list[Req], list[Req]]:
        """Requests whose decode side is ready (sender initialised), and those whose bootstrap failed."""
        ready, failed, keep = [], [], []
        page_size = self.engine.args.page_size
        for req in self.queue:
            state = self.polls.poll(req.disagg_kv)  # every TP rank's sender must have its decode peers
            if state == KVPoll.Failed:
                failed.append(req)
            elif state >= KVPoll.WaitingForInput:
                req.disagg_kv.init(num_pages(len(req.origin_input_ids), page_size))
                req.times.bootstrapped = time.monotonic()
                ready.append(req)
            else:
                keep.append(req)
        self.queue = keep
        return ready, failed

    def remove(self, req: Req) -> bool:
        if req in self.queue:
            self.queue.remove(req)
            return True
        return False
