"""``Speculator``: turns a decode step of the running batch into draft -> verify (``prepare``), or leaves it a plain
decode step when no request has drafts or their KV does not fit.

Per request, a step drafts at most ``min(draft_len, remaining - 1)`` tokens (``caps``): the accepted run plus the
target's own token never exceeds ``max_new_tokens``, so no verify position lies past the request's context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine.spec.info import VerifyInput
from common.engine.spec.verify import grammar_masks

if TYPE_CHECKING:
    from common.engine.req import Req
    from common.engine.schedule_batch import ScheduleBatch
    from common.engine.spec.drafter import Drafter


class Speculator:
    def __init__(self, drafter: Drafter, draft_len: int, vocab_size: int) -> None:
        self.drafter = drafter
        self.draft_len = draft_len
        self.vocab_size = vocab_size

    def caps(self, reqs: list[Req]) -> list[int]:
        """Draft tokens each request may get this step."""
        return [max(0, min(self.draft_len, r.sampling_params.max_new_tokens - len(r.output_ids) - 1)) for r in reqs]

    def prepare(self, batch: ScheduleBatch) -> bool:
        """Draft for ``batch`` (a running batch whose decode KV check passed) and prepare it as ``TARGET_VERIFY``;
        False: nothing drafted or no KV for the drafts, the caller prepares a plain decode step."""
        reqs = batch.reqs
        caps = self.caps(reqs)
        if not any(caps) or not batch.check_verify_mem([1 + c for c in caps]):
            return False
        drafts = [d[:c] for d, c in zip(self.drafter.propose(reqs, caps), caps, strict=True)]
        masks = []
        for i, req in enumerate(reqs):
            if req.grammar is not None:
                mask, drafts[i] = grammar_masks(req, drafts[i], self.vocab_size)
                masks.append(mask)
            else:
                masks.append(None)
        if not any(drafts):
            return False
        batch.prepare_for_verify(VerifyInput(drafts, masks, self.drafter))
        return True

    def close(self) -> None:
        self.drafter.close()
