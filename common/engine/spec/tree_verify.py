"""Verify a draft tree against the target's token at every node, and move the accepted path's KV into place.

The verify forward ran the target over the tree's ``n`` nodes of each request (``DraftTree``: positions
``seq_len + depth``, the ancestor mask), so row ``j`` of its output is the next-token distribution after node ``j``'s
path, and the sampler drew the target's token ``t_j`` there (its argmax for a greedy request; a sample of the
processed distribution otherwise: temperature, top-k/p, min-p, penalties, logit_bias, grammar, with the request's
uniform of output step ``s + depth(j)``).

    accept:  from the root, the child whose token equals the target's token at the current node, while one does;
             siblings hold distinct tokens (top-k of one distribution), so at most one child matches.
    emit:    the path's drafts, then the target's token at the path's end (``len(path)`` tokens).

Why sampling stays exact: at an accepted node with target distribution p, the drafts are fixed (point masses), so
child c is taken with probability p(c) and otherwise the emitted token is t ~ p conditioned on being no child: p
itself overall (SGLang's ``tree_speculative_sampling_target_only`` draws the same law from coins). Greedy requests
emit exactly the plain decode's tokens.

KV: the verify wrote node ``j``'s KV at ``slots[b, j]``, the slot of sequence position ``seq_len + j``. Path node
``path[i]`` must end at position ``seq_len + i``: ``compact_path_kv`` copies its KV there (every layer; the copy
reads every source before writing, and ``path[i] >= i``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.spec.eagle_tree import DraftTree


@dataclass
class TreeVerifyResult:
    paths: list[list[int]]  # per request: accepted node indices, root first (len = tokens emitted)
    tokens: list[list[int]]  # per request: the emitted tokens (the path's drafts, then the target's own)

    @property
    def accept_lens(self) -> list[int]:
        """Draft tokens accepted per request (emitted - 1)."""
        return [len(p) - 1 for p in self.paths]


def verify_tree(tree: DraftTree, target_ids: torch.Tensor) -> TreeVerifyResult:
    """``target_ids`` int64 [bs, n]: the target's token after each node (argmax or sampled)."""
    parents = tree.parents.clamp(min=0)
    match = tree.tokens == target_ids.gather(1, parents)
    accepted = torch.zeros_like(match)
    accepted[:, 0] = True
    for d in range(1, int(tree.depths.max()) + 1):
        accepted |= (tree.depths == d) & match & accepted.gather(1, parents)
    last = torch.where(accepted, tree.depths, -1).argmax(dim=1)  # the deepest accepted node (unique per depth)
    on_path = tree.mask[torch.arange(tree.tokens.shape[0], device=last.device), last]  # [bs, n]
    paths = [row.nonzero().flatten().tolist() for row in on_path.cpu()]
    ids = target_ids.cpu().tolist()
    return TreeVerifyResult(paths, [[ids[b][j] for j in path] for b, path in enumerate(paths)])


def compact_path_kv(pools: list[MHATokenToKVPool], slots: torch.Tensor, paths: list[list[int]]) -> None:
    """Copy the KV of each request's path node ``path[i]`` to ``slots[b, i]`` in every layer of ``pools``.
    ``slots`` int64 [bs, n]: the verify step's slots, in node order (node j at position seq_len + j)."""
    src, dst = [], []
    rows = slots.cpu().tolist()
    for b, path in enumerate(paths):
        for i, j in enumerate(path):
            if j != i:
                src.append(rows[b][j])
                dst.append(rows[b][i])
    if not src:
        return
    device = slots.device
    s, d = torch.tensor(src, device=device), torch.tensor(dst, device=device)
    for pool in pools:
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf[d] = buf[s]  # NOTE: buf[s] is a copy: every source is read before any destination is written
