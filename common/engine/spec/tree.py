"""Tree drafts (``--speculative-eagle-topk`` > 1) in the verify step: what a tree adds to a linear draft.

A request's tree is its draft tokens in topological order with their parents (``TreeDrafts``; -1: the root, the
request's last sampled token). Verify rows are the root and the drafts in that order, so everything indexed by row
in ``VerifyInput`` stays as for a chain; the tree changes four things::

    positions:      row j at committed + depth(j)              (a chain: committed + j)
    attention:      row j sees the prefix and its ancestors     ``ForwardBatch.custom_mask`` (``eagle_tree``)
    sampling rows:  row j's outputs as if its path were output  (``DraftRow`` with the path's tokens)
    grammar:        row j's mask after its path; a draft the grammar refuses at its parent is dropped, subtree too
    accept:         ``verify.accepted_path`` walks the tree; the path's KV is moved to consecutive positions
                    right after the forward (``path_kv.compact_path_kv``, by the drafter that drew the tree)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.engine.sampling.grammar import allocate_bitmask
from common.engine.spec.eagle_tree import ancestor_mask
from common.engine.spec.verify import DraftRow, _MaskRow

if TYPE_CHECKING:
    from common.engine.req import Req


@dataclass
class TreeDrafts:
    """What a tree drafter proposes: per request, its draft tokens and each one's parent (an earlier index, or -1)."""

    tokens: list[list[int]]
    parents: list[list[int]]


def depths(parents: list[int]) -> list[int]:
    """Depth of each draft (1: a child of the root)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each draft's path: the draft tokens from the root's child down to it."""
    out: list[list[int]] = []
    for t, p in zip(tokens, parents, strict=True):
        out.append([t] if p < 0 else [*out[p], t])
    return out


def prune(tokens: list[int], parents: list[int], keep: list[bool]) -> tuple[list[int], list[int]]:
    """The drafts with ``keep`` (a kept draft's parent must be kept), re-indexed."""
    new_index: list[int] = []
    out_t: list[int] = []
    out_p: list[int] = []
    for j, (t, p) in enumerate(zip(tokens, parents, strict=True)):
        new_index.append(len(out_t) if keep[j] else -1)
        if keep[j]:
            assert p < 0 or keep[p], "prune: a kept draft's parent was dropped"
            out_t.append(t)
            out_p.append(-1 if p < 0 else new_index[p])
    return out_t, out_p


def limit_depth(tokens: list[int], parents: list[int], cap: int) -> tuple[list[int], list[int]]:
    """The drafts at depth <= ``cap`` (a request near its ``max_new_tokens``)."""
    return prune(tokens, parents, [d <= cap for d in depths(parents)])


def tree_rows(req: Req, tokens: list[int], parents: list[int], masks: torch.Tensor | None) -> list[DraftRow]:
    """The request's sampling rows: the root, then each draft as if its path were already output."""
    rows = [DraftRow(req, [], None if masks is None else _MaskRow(masks[0]))]
    for j, path in enumerate(paths(tokens, parents)):
        rows.append(DraftRow(req, path, None if masks is None else _MaskRow(masks[j + 1])))
    return rows


def tree_grammar_masks(
    req: Req, tokens: list[int], parents: list[int], vocab_size: int
) -> tuple[torch.Tensor, list[int], list[int]]:
    """A constrained request's mask at each row (root first) and its tree without the drafts its grammar refuses at
    their parent (and their subtrees). The matcher ends where it started."""
    g = req.grammar
    n = len(tokens)
    children: list[list[int]] = [[] for _ in range(n + 1)]  # by row: 0 the root, j + 1 draft j
    for j, p in enumerate(parents):
        children[p + 1].append(j + 1)
    masks = allocate_bitmask(n + 1, vocab_size)
    keep = [False] * n
    stack: list[tuple[int, int]] = [(0, 0)]  # (row, children visited); the matcher is at the top row's state
    g.fill_bitmask(masks, 0)
    while stack:
        row, k = stack[-1]
        if k == len(children[row]):
            stack.pop()
            if stack:
                g.rollback(1)
            continue
        stack[-1] = (row, k + 1)
        child = children[row][k]
        if g.accept(tokens[child - 1]):
            keep[child - 1] = True
            g.fill_bitmask(masks, child)
            stack.append((child, 0))
    kept_t, kept_p = prune(tokens, parents, keep)
    rows = torch.tensor([0] + [j + 1 for j in range(n) if keep[j]], dtype=torch.int64)
    return masks[rows], kept_t, kept_p


def tree_positions_and_mask(
    committed: list[int], trees: list[tuple[list[int], list[int]]]
) -> tuple[list[int], torch.Tensor]:
    """Verify positions (root first, per request) and ``ForwardBatch.custom_mask`` for ``(tokens, parents)`` trees."""
    positions: list[int] = []
    masks: list[torch.Tensor] = []
    for c, (_, parents) in zip(committed, trees, strict=True):
        d = depths(parents)
        positions += [c] + [c + x for x in d]
        rows = torch.tensor([[-1] + [p + 1 for p in parents]], dtype=torch.int64)
        masks.append(ancestor_mask(rows, max(d, default=0))[0].reshape(-1))
    return positions, torch.cat(masks)
