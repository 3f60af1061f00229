"""``Speculator``: turns a decode step of the running batch into draft -> verify (``prepare``), or leaves it a plain
decode step when no request has drafts or their KV does not fit.

Per request, a step drafts at most ``min(draft_len, remaining - 1)`` tokens (``caps``): the accepted run plus the
target's own token never exceeds ``max_new_tokens``, so no verify position lies past the request's context. A tree
drafter (``TreeDrafts``) keeps its drafts at depth <= the cap, up to ``max_drafts`` of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine.spec.info import VerifyInput
from common.engine.spec.tree import TreeDrafts, limit_depth, tree_grammar_masks
from common.engine.spec.verify import grammar_masks

if TYPE_CHECKING:
    from common.engine.req import Req
    from common.engine.schedule_batch import ScheduleBatch
    from common.engine.spec.drafter import Drafter


class Speculator:
    def __init__(self, drafter: Drafter, draft_len: int, vocab_size: int, max_drafts: int | None = None) -> None:
        """``max_drafts``: draft tokens a request's tree may hold (default ``draft_len``: a chain)."""
        self.drafter = drafter
        self.draft_len = draft_len
        self.vocab_size = vocab_size
        self.max_drafts = draft_len if max_drafts is None else max_drafts

    def caps(self, reqs: list[Req]) -> list[int]:
        """Draft tokens each request may get this step."""
        return [max(0, min(self.draft_len, r.sampling_params.max_new_tokens - len(r.output_ids) - 1)) for r in reqs]

    def prepare(self, batch: ScheduleBatch) -> bool:
        """Draft for ``batch`` (a running batch whose decode KV check passed) and prepare it as ``TARGET_VERIFY``;
        False: nothing drafted or no KV for the drafts, the caller prepares a plain decode step."""
        reqs = batch.reqs
        caps = self.caps(reqs)
        budget = [1 + (self.max_drafts if c else 0) for c in caps]
        if not any(caps) or not batch.check_verify_mem(budget):
            return False
        proposed = self.drafter.propose(reqs, caps)
        if isinstance(proposed, TreeDrafts):
            return self._prepare_trees(batch, proposed, caps)
        drafts = [d[:c] for d, c in zip(proposed, caps, strict=True)]
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

    def _prepare_trees(self, batch: ScheduleBatch, trees: TreeDrafts, caps: list[int]) -> bool:
        tokens, parents, masks = [], [], []
        for req, t, p, cap in zip(batch.reqs, trees.tokens, trees.parents, caps, strict=True):
            t, p = limit_depth(t, p, cap)
            mask = None
            if req.grammar is not None:
                mask, t, p = tree_grammar_masks(req, t, p, self.vocab_size)
            tokens.append(t)
            parents.append(p)
            masks.append(mask)
        if not any(tokens):
            return False
        batch.prepare_for_verify(VerifyInput(tokens, masks, self.drafter, parents=parents))
        return True

    def close(self) -> None:
        self.drafter.close()
