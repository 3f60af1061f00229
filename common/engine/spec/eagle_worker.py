"""``EagleWorker``: the draft head's forwards for one rank: DRAFT_EXTEND over committed tokens, then the draft steps
that grow a request's tree (``common.engine.spec.eagle_tree``).

The head's KV pool has one layer and the target's slot numbering: position p of a request has its head K/V at the
slot the target's ``req_to_token`` row gives for p, so the target's page allocation, prefix cache and frees cover
it. Past the target's pages the pool holds scratch slots for the draft steps' tokens (never allocated, overwritten
by the next step)::

    slots:  [ page 0 (pad) | the target's pages 1 .. num_pages | scratch: max_batch * topk * (num_steps - 1) ]

Head rows (``eagle_model``): the row at position p reads x_{p+1} and the feature at p. Per request, after the target
committed positions [0, C) and sampled x_C (``verified``)::

    DRAFT_EXTEND  rows at [P, C) with tokens x_{P+1} .. x_C and the target's features at P .. C-1: writes the head's
                  K/V there; its last row's top-k are the tree's first level, its output the state's feature.
                  After a verify / decode step through ``extend_graph_runner`` when it fits; after a prefill
                  forward (EXTEND) eagerly.
    draft step i  (1 .. num_steps-1) one row per branch at position C + i - 1: the branch's token, its parent's
                  feature; attends the request's [0, C) plus the branch's own chain of earlier steps' scratch slots
                  (a per-branch row of ``branch_table``), so each branch sees exactly its ancestors.

A step's state per request (SGLang's ``EagleDraftInput``): the last row's top-k probabilities and target ids, and
its output feature; in P/D it is what a decode node needs to draft its first step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.spec.draft_extend_graph_runner import EagleExtendGraphRunner
from common.engine.spec.eagle_graph_runner import DraftGraphRunner
from common.engine.spec.eagle_model import EagleHead
from common.engine.spec.eagle_tree import DraftLevels, DraftTree, build_tree


@dataclass
class DraftState:
    """Per request of a batch (rows in batch order): what the next draft starts from."""

    topk_p: torch.Tensor  # fp32 [bs, topk]
    topk_ids: torch.Tensor  # int64 [bs, topk], target ids
    hidden: torch.Tensor  # [bs, hidden]: the head's feature at the last committed position

    def select(self, rows: list[int]) -> DraftState:
        idx = torch.tensor(rows, dtype=torch.int64, device=self.hidden.device)
        return DraftState(self.topk_p[idx], self.topk_ids[idx], self.hidden[idx])

    @staticmethod
    def cat(states: list[DraftState]) -> DraftState:
        return DraftState(*(torch.cat([getattr(s, f) for s in states]) for f in ("topk_p", "topk_ids", "hidden")))


class EagleWorker:
    def __init__(
        self, head: EagleHead, num_pages: int, page_size: int, max_batch: int, topk: int, num_steps: int,
        num_draft_tokens: int, backend: str = "torch",
    ) -> None:
        self.head = head
        self.topk, self.num_steps, self.num_draft_tokens = topk, num_steps, num_draft_tokens
        self.page_size = page_size
        scratch = max_batch * topk * max(num_steps - 1, 0)
        lc = head.config.layer
        dtype = head.fc.weight.dtype
        self.kv_pool = MHATokenToKVPool(num_pages + -(-scratch // page_size), page_size, dtype, head.num_kv_heads,
                                        lc.head_dim, 1, head.device)
        self.scratch_base = (num_pages + 1) * page_size
        self.max_batch = max_batch
        self.attn_backend = head.make_attn_backend(backend)
        self.graph_runner: DraftGraphRunner | None = None  # the draft steps' graphs / compiled steps, if any
        self.extend_graph_runner: EagleExtendGraphRunner | None = None  # the decode-time extends', if any

    @torch.inference_mode()
    def extend(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: list[int],
        seq_lens: list[int], req_to_token: torch.Tensor, mode: ForwardMode = ForwardMode.DRAFT_EXTEND,
    ) -> DraftState:
        """DRAFT_EXTEND: request i's rows at positions [prefix_lens[i], seq_lens[i]) with ``input_ids`` (x_{p+1},
        the last one the token just sampled) and ``hidden`` (the target's features at those positions), packed in
        order. Writes the head's K/V at the target's slots of those positions; returns each request's state.
        ``mode``: DRAFT_EXTEND after a verify / decode step (``extend_graph_runner`` serves it when it fits), EXTEND
        after a prefill forward (eager)."""
        device = self.head.device
        ext = [s - p for p, s in zip(prefix_lens, seq_lens, strict=True)]
        i64 = torch.int64
        positions = torch.cat([torch.arange(p, s, dtype=i64) for p, s in zip(prefix_lens, seq_lens, strict=True)])
        positions = positions.to(device)
        rows = req_pool_indices.repeat_interleave(torch.tensor(ext, device=req_pool_indices.device))
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(ext), input_ids=input_ids.to(device, i64), positions=positions,
            out_cache_loc=req_to_token[rows.to(req_to_token.device), positions.to(req_to_token.device)].to(device),
            req_pool_indices=req_pool_indices.to(device), seq_lens=torch.tensor(seq_lens, dtype=i64, device=device),
            extend_lens=torch.tensor(ext, dtype=i64, device=device),
            prefix_lens=torch.tensor(prefix_lens, dtype=i64, device=device), req_to_token=req_to_token,
            seq_lens_cpu=list(seq_lens), extend_lens_cpu=ext, prefix_lens_cpu=list(prefix_lens),
            kv_pool=self.kv_pool, attn_backend=self.attn_backend,
        )
        if self.extend_graph_runner is not None and self.extend_graph_runner.can_run(fb):
            logit_h, feature = self.extend_graph_runner.forward(fb, hidden)
        else:
            logit_h, feature = self.head(fb, hidden)
        last = torch.cumsum(torch.tensor(ext, device=device), 0) - 1
        p, ids = self.head.draft_topk(logit_h[last], self.topk)
        return DraftState(p, ids, feature[last])

    @torch.inference_mode()
    def draft(
        self, state: DraftState, verified_ids: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: list[int],
        req_to_token: torch.Tensor,
    ) -> DraftTree:
        """Grow each request's tree from ``state`` (``num_steps - 1`` head forwards of ``bs * topk`` rows) and keep
        its ``num_draft_tokens`` best nodes. ``seq_lens[i]``: request i's committed positions C (its verified token
        ``verified_ids[i]`` sits at C)."""
        bs, k = len(seq_lens), self.topk
        if bs > self.max_batch:
            raise ValueError(f"EagleWorker.draft: {bs} requests, the scratch holds {self.max_batch}")
        device, i64 = self.head.device, torch.int64
        levels = DraftLevels(k)
        tokens, parent_rows = levels.add_step(state.topk_p, state.topk_ids)
        hidden = state.hidden[parent_rows]
        if self.num_steps > 1:
            width = max(seq_lens) + self.num_steps
            table = torch.zeros(bs * k, width, dtype=i64, device=device)
            base = req_to_token[req_pool_indices.to(req_to_token.device), : max(seq_lens)].to(device)
            table[:, : base.shape[1]] = base.repeat_interleave(k, dim=0)
            committed = torch.tensor(seq_lens, dtype=i64, device=device).repeat_interleave(k)
            branch = torch.arange(bs * k, device=device)
        for i in range(1, self.num_steps):
            # step i: one row per branch at position C + i - 1, its own scratch slot, its chain in its table row
            out_loc = self.scratch_base + ((torch.arange(bs, device=device) * (self.num_steps - 1) + i - 1) * k
                                           ).repeat_interleave(k) + branch % k
            table = table[parent_rows if i > 1 else branch]
            table[branch, committed + i - 1] = out_loc
            lens = committed + i
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=bs * k, input_ids=tokens.to(device, i64),
                positions=lens - 1, out_cache_loc=out_loc, req_pool_indices=branch, seq_lens=lens,
                extend_lens=torch.ones_like(lens), prefix_lens=lens - 1, req_to_token=table,
                seq_lens_cpu=[s + i for s in seq_lens for _ in range(k)], extend_lens_cpu=[1] * (bs * k),
                prefix_lens_cpu=[s + i - 1 for s in seq_lens for _ in range(k)], kv_pool=self.kv_pool,
                attn_backend=self.attn_backend,
            )
            if self.graph_runner is not None and self.graph_runner.can_run(fb):
                logit_h, feature = self.graph_runner.forward(fb, hidden)
            else:
                logit_h, feature = self.head(fb, hidden)
            p, ids = self.head.draft_topk(logit_h, k)
            tokens, parent_rows = levels.add_step(p, ids)
            hidden = feature[parent_rows]
        return build_tree(verified_ids.to(device), levels, self.num_draft_tokens)
