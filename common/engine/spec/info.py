"""``VerifyInput``: the ``spec_info`` of a ``TARGET_VERIFY`` batch (the seeds' ``EagleVerifyInput``), travelling
``ScheduleBatch`` -> ``ModelWorkerBatch`` -> ``ForwardBatch`` like the batch's other fields.

Token layout of one verify forward (request i has ``len(drafts[i])`` drafts, possibly none)::

    input_ids:  | req0: last d1 .. dk | req1: last | req2: last d1 .. dk' | ...
    rows:       offsets[i] .. offsets[i] + len(drafts[i])    (one sampled target token per row)
    positions:  committed[i] .. committed[i] + len(drafts[i])

A tree draft (``parents``; ``common.engine.spec.tree``) keeps these rows, root first, drafts in topological order;
row j then sits at position committed + depth(j) and sees only its ancestors, and the accepted path's KV is moved
to consecutive positions before ``commit`` trims (by the drafter that drew the tree, right after the forward).

KV pages per request (``ScheduleBatch.prepare_for_verify`` / ``trim_verified_kv``)::

    before:  [0, C)                      committed KV (C = committed[i]; the last sampled token has none yet)
    verify:  [C, C + k + 1) allocated    the last token and its k drafts, written by the forward
    after:   [0, C + m) kept             m >= 1 tokens emitted: the last token and the m - 1 accepted drafts
             pages wholly past C + m     freed at once (the rejected drafts')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from common.engine.spec.tree import tree_positions_and_mask, tree_rows
from common.engine.spec.verify import accept_length, accepted_path, draft_rows

if TYPE_CHECKING:
    from common.engine.req import Req
    from common.engine.schedule_batch import ScheduleBatch
    from common.engine.scheduler_metrics import DecodeLogInterval
    from common.engine.spec.drafter import Drafter


@dataclass
class VerifyInput:
    drafts: list[list[int]]  # per request of the batch: its draft tokens d1..dk (k >= 0)
    grammar_masks: list[torch.Tensor | None]  # per request: its rows' grammar bitmask [k + 1, words], or None
    drafter: Drafter  # told of each request's outcome (``Drafter.on_verified``)
    committed: list[int] = field(default_factory=list)  # per request: KV length before the forward (C)
    offsets: list[int] = field(default_factory=list)  # per request: its first row among the forward's tokens
    parents: list[list[int]] | None = None  # tree drafts: per request, each draft's parent (-1: the last token)

    def tree_inputs(self) -> tuple[list[int], torch.Tensor] | None:
        """A tree's verify positions and ``ForwardBatch.custom_mask`` (after ``prepare_for_verify``); None: chains."""
        if self.parents is None:
            return None
        return tree_positions_and_mask(self.committed, list(zip(self.drafts, self.parents, strict=True)))

    def path(self, i: int, next_token_ids: list[int]) -> list[int]:
        """Request i's accepted drafts (indices into ``drafts[i]``), in order."""
        start, drafts = self.offsets[i], self.drafts[i]
        targets = next_token_ids[start : start + len(drafts) + 1]
        if self.parents is None:
            return list(range(accept_length(targets, drafts)))
        return accepted_path(targets, drafts, self.parents[i])

    @property
    def extend_lens(self) -> list[int]:
        return [1 + len(d) for d in self.drafts]

    def sampling_rows(self, reqs: list[Req]) -> list[Any]:
        """One sampling row per forward token, in token order (``SamplingBatchInfo.from_reqs`` reads them)."""
        rows: list[Any] = []
        for i, (req, drafts, masks) in enumerate(zip(reqs, self.drafts, self.grammar_masks, strict=True)):
            if self.parents is None:
                rows += draft_rows(req, drafts, masks)
            else:
                rows += tree_rows(req, drafts, self.parents[i], masks)
        return rows

    def accepted_rows(self, i: int, next_token_ids: list[int]) -> list[int]:
        """Rows of request i whose sampled tokens it emits, in order: t_0 .. t_a (a tree: the root, then its
        accepted path's rows)."""
        start = self.offsets[i]
        return [start] + [start + 1 + j for j in self.path(i, next_token_ids)]

    def commit(self, batch: ScheduleBatch, req: Req, i: int, emitted: int, log: DecodeLogInterval) -> None:
        """Request i emitted ``emitted`` tokens of its accepted run (fewer when one ended it): keep the KV of the
        tokens before the newest, free the rest's pages, count the step."""
        if req.req_pool_idx is not None:
            batch.trim_verified_kv(req, self.committed[i] + max(emitted, 1))
        drafted = len(self.drafts[i])
        if not drafted:
            return
        accepted = max(emitted - 1, 0)
        req.spec_verify_ct += 1
        req.spec_draft_tokens += drafted
        req.spec_accepted_tokens += accepted
        log.verify_steps += 1
        log.verify_tokens += emitted
        self.drafter.on_verified(req, drafted, accepted)
