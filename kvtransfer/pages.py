"""Page-run coalescing and KV-head slicing (heterogeneous TP).

A chunk maps source pages to destination pages one to one. Runs where both sides advance by exactly one page are
merged so a backend moves one span per run per layer (per K and V)::

    src: 7 8 9 | 3 | 4 5     ->  PageRun(7, 20, 3), PageRun(3, 40, 1), PageRun(4, 41, 2)
    dst: 20 21 22 | 40 | 41 42    (3->40 then 4->41 is contiguous on both sides but 9->22 then 3->40 is not)

Heads: with ``total`` KV heads over ``tp`` ranks, rank r holds heads [r*total/tp, (r+1)*total/tp) when total >= tp,
else the single replicated head r // (tp/total). A decode rank takes each head it holds from exactly one prefill
rank (the lowest-numbered holder); ``HeadSlice`` says where that head range sits in each side's slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from common.engine.model.parallel import owned_kv_heads


class PageRun(NamedTuple):
    """``num_pages`` pages from ``src_page`` on go to ``dst_page`` on (a tuple: a request builds one per run)."""

    src_page: int
    dst_page: int
    num_pages: int


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Heads [src_head, src_head+num_heads) of a source slot go to [dst_head, dst_head+num_heads) of a dest slot."""

    src_head: int
    dst_head: int
    num_heads: int


def pages_outside(pages: Sequence[int], num_pages: int) -> list[int]:
    """The page numbers not in [1, num_pages) (page 0 is the padding page), in order; [] when all are valid."""
    if not len(pages) or (min(pages) > 0 and max(pages) < num_pages):
        return []
    return [p for p in pages if not 0 < p < num_pages]


def unheld_pairs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> tuple[list[int], list[int]]:
    """The (source, destination) page pairs the decode side does not hold already: destination page 0 (the padding
    page, never allocated) marks a page it shares from an earlier request (``decode_node``, shared prompts)."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"page count mismatch: {len(src_pages)} source vs {len(dst_pages)} destination pages")
    keep = [i for i, d in enumerate(dst_pages) if d != 0]
    if len(keep) == len(dst_pages):
        return list(src_pages), list(dst_pages)
    return [src_pages[i] for i in keep], [dst_pages[i] for i in keep]


def coalesce_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[PageRun]:
    """Maximal runs contiguous on both sides, in chunk order."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"page count mismatch: {len(src_pages)} source vs {len(dst_pages)} destination pages")
    if not len(src_pages):
        return []
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src)]))
    return [PageRun(s, d, n) for s, d, n in zip(src[starts].tolist(), dst[starts].tolist(), (ends - starts).tolist(),
                                                 strict=True)]


def split_runs(runs: Sequence[PageRun], parts: int) -> list[tuple[PageRun, ...]]:
    """``runs`` cut into ``parts`` consecutive stripes of equal page counts (the first ones one page more when
    the pages do not divide): together they are ``runs`` in order, page for page; a run may be cut in two."""
    total = sum(r.num_pages for r in runs)
    if not 1 <= parts <= max(total, 1):
        raise ValueError(f"cannot split {total} pages into {parts} stripes")
    sizes = [total // parts + (k < total % parts) for k in range(parts)]
    stripes: list[tuple[PageRun, ...]] = []
    it = iter(runs)
    run: PageRun | None = None
    for size in sizes:
        stripe: list[PageRun] = []
        while size:
            run = run or next(it)
            take = min(size, run.num_pages)
            if take:
                stripe.append(PageRun(run.src_page, run.dst_page, take))
            size -= take
            rest = run.num_pages - take
            run = PageRun(run.src_page + take, run.dst_page + take, rest) if rest else None
        stripes.append(tuple(stripe))
    return stripes


def owned_heads(tp_rank: int, tp_size: int, total_heads: int) -> range:
    """Global KV heads held by one TP rank (replicated when total_heads < tp_size): the model's own rule, so the
    heads a rank sends or receives are exactly the heads its KV pool holds."""
    return owned_kv_heads(tp_rank, tp_size, total_heads)


def source_plan(dst_rank: int, dst_tp: int, src_tp: int, total_heads: int) -> list[tuple[int, HeadSlice]]:
    """(source rank, slice) pairs that together fill every head of ``dst_rank``; each head from one source."""
    needed = owned_heads(dst_rank, dst_tp, total_heads)
    plan, covered = [], needed.start
    for src_rank in range(src_tp):
        held = owned_heads(src_rank, src_tp, total_heads)
        lo, hi = max(covered, held.start), min(needed.stop, held.stop)
        if lo < hi and lo == covered:
            plan.append((src_rank, HeadSlice(lo - held.start, lo - needed.start, hi - lo)))
            covered = hi
    if covered != needed.stop:
        raise ValueError(f"heads {needed} of decode rank {dst_rank}/{dst_tp} not covered by {src_tp} prefill ranks")
    return plan


def head_slice_for(src_rank: int, src_tp: int, dst_rank: int, dst_tp: int, total_heads: int) -> HeadSlice | None:
    """What ``src_rank`` sends to ``dst_rank`` (None if it sends nothing to it)."""
    return dict(source_plan(dst_rank, dst_tp, src_tp, total_heads)).get(src_rank)


def dst_ranks_served(src_rank: int, src_tp: int, dst_tp: int, total_heads: int) -> list[int]:
    """Decode ranks (of one DP group) that take heads from ``src_rank``: how many TransferInfos it waits for."""
    return [d for d in range(dst_tp) if head_slice_for(src_rank, src_tp, d, dst_tp, total_heads) is not None]


def is_whole_page(heads: HeadSlice, src_kv_heads: int, dst_kv_heads: int) -> bool:
    return heads.src_head == 0 and heads.dst_head == 0 and heads.num_heads == src_kv_heads == dst_kv_heads


def copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[PageRun], page_size: int,
              heads: HeadSlice | None = None) -> None:
    """Copy page runs (and a head slice) between two [num_slots, kv_heads, head_dim] buffers as slice copies.

    Slices, not ``index_select``: on CPU a gather is slower than copying contiguous runs.
    """
    for run in runs:
        s0, d0, n = run.src_page * page_size, run.dst_page * page_size, run.num_pages * page_size
        if heads is None:
            dst[d0:d0 + n].copy_(src[s0:s0 + n])
        else:
            dst[d0:d0 + n, heads.dst_head:heads.dst_head + heads.num_heads].copy_(
                src[s0:s0 + n, heads.src_head:heads.src_head + heads.num_heads])
