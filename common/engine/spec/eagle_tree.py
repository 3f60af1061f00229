"""EAGLE's draft tree: top-k expansion per draft step, then the ``num_draft_tokens`` best nodes by path score.

Candidates of one request, in flat order (SGLang's ``build_tree_kernel_efficient`` layout)::

    step 0:       k candidates            flat 0 .. k-1            (children of the root, the verified token)
    step i >= 1:  k * k candidates        flat k + (i-1)k^2 + p*k + c   (child c of branch p of step i - 1)

A candidate's score is the product of the draft probabilities along its path; a branch of step i is one of the k
best candidates of step i (what the next draft step expands). The tree keeps the root plus the ``n - 1`` best
candidates: a child's score never exceeds its parent's (probabilities <= 1, and rounding a product by p <= 1 never
rounds above the factor), and ties go to the lower flat index, which the parent always has, so every kept node's
parent is kept. Nodes are ordered by flat index, so a parent's node index is below its children's::

    node:     0 (root) | 1 .. n-1 (kept candidates by flat index)
    parents:  -1       | node index of the parent (0: the root)
    mask:     [n, n] ancestor-or-self: node j sees node k iff k is on j's path (the verify step's attention)
    position: seq_len + depth (the root, the last accepted token, sits at seq_len: its KV is not written yet)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftLevels:
    """Every candidate drafted for a batch so far: per step, [bs, C_i] scores, target token ids, the flat index of
    the parent candidate (-1: the root) and the depth (step + 1)."""

    topk: int
    scores: list[torch.Tensor] = field(default_factory=list)
    tokens: list[torch.Tensor] = field(default_factory=list)
    parents: list[torch.Tensor] = field(default_factory=list)
    # the current branches: scores [bs, k] and flat indices [bs, k]
    branch_scores: torch.Tensor | None = None
    branch_flat: torch.Tensor | None = None

    @property
    def num_steps(self) -> int:
        return len(self.scores)

    def add_step(self, topk_p: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Record one draft step's top-k and choose the next branches.

        ``topk_p``/``topk_ids``: step 0 [bs, k] (the draft's output at each request's last position); step i >= 1
        [bs * k, k] (row b * k + p: branch p's next-token top-k). Returns (the next branches' tokens [bs * k], the
        row of the current step each branch extends [bs * k]: the row whose hidden state and KV chain it inherits;
        at step 0 row b * k + j is request b's row, given as b).
        """
        k = self.topk
        device = topk_p.device
        if not self.scores:
            bs = topk_p.shape[0]
            self.scores.append(topk_p.float())
            self.tokens.append(topk_ids)
            self.parents.append(torch.full((bs, k), -1, dtype=torch.int64, device=device))
            self.branch_scores = topk_p.float()
            self.branch_flat = torch.arange(k, device=device).expand(bs, k)
            return topk_ids.reshape(-1), torch.arange(bs, device=device).repeat_interleave(k)
        assert self.branch_scores is not None and self.branch_flat is not None
        bs = self.branch_scores.shape[0]
        offset = k + (self.num_steps - 1) * k * k
        expand = (self.branch_scores[:, :, None] * topk_p.float().view(bs, k, k)).view(bs, k * k)
        tokens = topk_ids.view(bs, k * k)
        self.scores.append(expand)
        self.tokens.append(tokens)
        self.parents.append(self.branch_flat.repeat_interleave(k, dim=1))
        best_p, best = expand.topk(k, dim=-1)  # [bs, k] indices into p*k + c
        self.branch_scores = best_p
        self.branch_flat = offset + best
        rows = (torch.arange(bs, device=device)[:, None] * k + best // k).reshape(-1)
        return tokens.gather(1, best).reshape(-1), rows


@dataclass
class DraftTree:
    """The verify step's draft of a batch: ``n`` nodes per request (module docstring)."""

    tokens: torch.Tensor  # int64 [bs, n]; node 0 is the verified token
    parents: torch.Tensor  # int64 [bs, n]; -1 at the root
    depths: torch.Tensor  # int64 [bs, n]
    mask: torch.Tensor  # bool [bs, n, n]: ancestor-or-self
    scores: torch.Tensor | None = None  # fp32 [bs, n]: the draft's path probability (1 at the root); None: unknown

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    def positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """int64 [bs * n]: each node's sequence position (``seq_lens``: tokens with KV before the verify step)."""
        return (seq_lens[:, None] + self.depths).reshape(-1)

    def custom_mask(self) -> torch.Tensor:
        """``ForwardBatch.custom_mask``: the requests' [n, n] masks flattened one after another."""
        return self.mask.reshape(-1)

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> DraftTree:
        """A linear draft (top-k 1): node j's parent is j - 1. ``tokens`` [bs, n], the verified token first."""
        bs, n = tokens.shape
        ar = torch.arange(n, device=tokens.device)
        return cls(
            tokens=tokens,
            parents=(ar - 1).expand(bs, n).clone(),
            depths=ar.expand(bs, n).clone(),
            mask=torch.tril(torch.ones(n, n, dtype=torch.bool, device=tokens.device)).expand(bs, n, n).clone(),
        )


def build_tree(verified_ids: torch.Tensor, levels: DraftLevels, num_draft_tokens: int) -> DraftTree:
    """Keep the root and the ``num_draft_tokens - 1`` best candidates of ``levels`` (module docstring)."""
    n = num_draft_tokens
    scores = torch.cat(levels.scores, dim=1)
    if n - 1 > scores.shape[1]:
        raise ValueError(f"num_draft_tokens {n} exceeds the {scores.shape[1]} drafted candidates + the root")
    tokens = torch.cat(levels.tokens, dim=1)
    parent_flat = torch.cat(levels.parents, dim=1)
    depth = torch.cat([torch.full_like(t, i + 1) for i, t in enumerate(levels.tokens)], dim=1)
    bs, device = scores.shape[0], scores.device
    # NOTE: a stable sort: among equal scores the lower flat index (a parent before its child) comes first.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : n - 1]
    kept = torch.sort(order, dim=1).values  # [bs, n - 1] flat indices in flat order
    node_of = torch.full_like(scores, -1, dtype=torch.int64)
    node_of.scatter_(1, kept, torch.arange(1, n, device=device).expand(bs, n - 1))
    pflat = parent_flat.gather(1, kept)
    pnode = torch.where(pflat < 0, 0, node_of.gather(1, pflat.clamp(min=0)))
    if bool((pnode < 0).any()):
        raise AssertionError("draft tree: a kept node's parent was not kept (scores not monotone along paths)")
    root = torch.zeros(bs, 1, dtype=torch.int64, device=device)
    parents = torch.cat([root - 1, pnode], dim=1)
    depths = torch.cat([root, depth.gather(1, kept)], dim=1)
    return DraftTree(
        tokens=torch.cat([verified_ids.reshape(bs, 1).to(tokens.dtype), tokens.gather(1, kept)], dim=1),
        parents=parents,
        depths=depths,
        mask=ancestor_mask(parents, int(depths.max())),
        scores=torch.cat([torch.ones(bs, 1, device=device), scores.gather(1, kept)], dim=1),
    )


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """bool [bs, n, n]: mask[b, j, a] iff node a is node j or one of its ancestors (``parents`` [bs, n], -1 root)."""
    bs, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(bs, n, n).clone()
    cur = parents
    for _ in range(max_depth):
        has = cur >= 0
        mask.scatter_(2, cur.clamp(min=0)[:, :, None], has[:, :, None] | mask.gather(2, cur.clamp(min=0)[:, :, None]))
        cur = torch.where(has, parents.gather(1, cur.clamp(min=0)), cur)
    return mask
