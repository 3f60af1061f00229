"""Verification: the target's token at every draft position, and which drafts it accepts.

A ``TARGET_VERIFY`` forward feeds request i its last sampled token and its drafts d1..dk at positions C..C+k
(C: its committed KV length) and samples a target token t_j at every position j. Each position's logits go through
exactly what a plain decode step does to them (penalties, logit_bias, grammar mask, temperature, top-k, top-p,
min-p) as if the drafts before it were already output (``DraftRow``), and are drawn with the uniform of output step
s + j (``seeded_uniform(seed, s + j)`` for a seeded request)::

    row j:      0          1          ...   k
    input:      last       d1               dk
    sample:     t_0        t_1              t_k
    accept:     d1 == t_0  d2 == t_1        (the bonus token)

The request emits t_0 .. t_a, where a is the number of leading drafts equal to the target's samples (then
d_j = t_(j-1) for j <= a: the emitted tokens are the drafts the target agreed with, plus its own next one).

Why this preserves the target's distribution: it is rejection sampling for a proposal q_j that puts all its mass on
one token (an n-gram lookup's or a greedy draft model's d_j). Rejection sampling accepts d_j with probability
min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j), and on rejection draws from norm(max(p_j - q_j, 0)), which is p_j without
d_j. Here d_j is accepted exactly when t_(j-1) ~ p_j equals it (probability p_j(d_j)), and otherwise the emitted
token is t_(j-1) conditioned on differing from d_j: p_j without d_j. So every emitted token has the target's
distribution given the tokens before it. Greedy requests emit the plain decode's argmax tokens, and a seeded request
the tokens of its run without speculation (the same uniform for the same output step) - up to rounding: a verify
(an extend) computes the logits a decode step does to rounding, so a near tie (an argmax, or two tokens next to each
other in the sorted order a sampled draw walks) can fall the other way.

Tree drafts (``parents``, for drafters with topk > 1) are verified by the same rule walked down the tree: from the
root (the last sampled token), the child whose token equals the target's sample at the current node is accepted;
the walk ends where no child matches, emitting the target's sample there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from common.engine.sampling.grammar import allocate_bitmask

if TYPE_CHECKING:
    from common.engine.req import Req


def accept_length(targets: Sequence[int], drafts: Sequence[int]) -> int:
    """Leading drafts equal to the target's samples at the positions before them (a linear draft)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def accepted_path(targets: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
    """A tree draft's accepted nodes, root first (excluded). Node n (0-based) holds ``tokens[n]`` under
    ``parents[n]`` (-1: the root); ``targets[0]`` is the target's sample at the root, ``targets[n + 1]`` at node n.
    A chain (``parents[n] == n - 1``) gives the first ``accept_length`` nodes."""
    path: list[int] = []
    node = -1
    while True:
        want = targets[node + 1]
        child = next((n for n, p in enumerate(parents) if p == node and tokens[n] == want), None)
        if child is None:
            return path
        path.append(child)
        node = child


class _MaskRow:
    """A precomputed grammar mask row in the place of a request's matcher (``SamplingBatchInfo.from_reqs``)."""

    __slots__ = ("mask",)

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.mask)


class DraftRow:
    """Request ``req`` at verify position j: its outputs as if its first j drafts were already appended. Sampling
    reads it as it reads a request (``SamplingBatchInfo.from_reqs``, ``PenaltyState.from_reqs``)."""

    __slots__ = (
        "eos_token_ids",
        "extra",
        "grammar",
        "origin_input_ids",
        "req",
        "return_logprob",
        "sampling_params",
        "top_logprobs_num",
    )

    def __init__(self, req: Req, extra: list[int], grammar: Any) -> None:
        self.req = req
        self.extra = extra
        self.grammar = grammar
        self.sampling_params = req.sampling_params
        self.origin_input_ids = req.origin_input_ids
        self.eos_token_ids = req.eos_token_ids
        self.return_logprob = req.return_logprob
        self.top_logprobs_num = req.top_logprobs_num

    @property
    def output_ids(self) -> list[int]:
        return self.req.output_ids + self.extra if self.extra else self.req.output_ids

    def draw_step(self) -> int:
        return self.req.draw_step() + len(self.extra)

    def generated_ids(self) -> list[int]:
        return self.req.generated_ids() + self.extra if self.extra else self.req.generated_ids()


def draft_rows(req: Req, drafts: list[int], masks: torch.Tensor | None) -> list[DraftRow]:
    """The request's ``len(drafts) + 1`` sampling rows (one per verify position)."""
    return [DraftRow(req, drafts[:j], None if masks is None else _MaskRow(masks[j])) for j in range(len(drafts) + 1)]


def grammar_masks(req: Req, drafts: list[int], vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    """A constrained request's mask at each verify position, and its drafts cut before the first one its grammar
    refuses there (the target could never sample it). The matcher ends where it started."""
    g = req.grammar
    masks = allocate_bitmask(len(drafts) + 1, vocab_size)
    kept = 0
    try:
        for j in range(len(drafts) + 1):
            g.fill_bitmask(masks, j)
            if j == len(drafts) or not g.accept(drafts[j]):
                break
            kept += 1
    finally:
        if kept:
            g.rollback(kept)
    return masks[: kept + 1], drafts[:kept]
