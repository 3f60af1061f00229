"""``Drafter``: what proposes a decode step's draft tokens. One per scheduler rank, built from the flags by
``common.engine.spec.build_speculator``; one module per algorithm (``ngram``, ``standalone``).

Where it is asked (``Speculator.prepare``, inside the scheduler's decode step, on the scheduler thread)::

    update_running_batch: filter, KV check / retract -> caps per request -> drafter.propose(reqs, caps)
        -> grammar masks (drafts cut where the grammar refuses) -> ScheduleBatch.prepare_for_verify
    run: one TARGET_VERIFY forward of the target, a sampled token at every position
    process_batch_result: each request's accepted run appended token by token (stops, EOS, max_new_tokens
        checked inside the run), its rejected pages freed -> drafter.on_verified(req, drafted, accepted)
    a request's slot freed (finish, abort, retraction) -> drafter.release([row]) at once

The contract, for the drafters built here and those to come:

- Linear drafts (topk 1): ``propose`` returns request i's chain d1..dk with k <= ``caps[i]`` (0 allowed: that
  request decodes one token this step). The target verifies [last, d1..dk] as an extend under the causal mask, so
  no new attention kernel is involved; ``common.engine.spec.verify`` says why its accept rule is exact.
- Proposals are point masses (the drafter picks its tokens deterministically: a lookup, a greedy draft model). A
  drafter that samples its drafts from a distribution q would need ``verify`` to compare p/q: not built.
- State a drafter keeps per request lives on ``Req.spec_state`` (it goes with the request) or per request slot
  (``release`` frees it with the slot); whatever it holds of the KV kind is freed by ``release``.
- Tree drafts (topk > 1, EAGLE): ``propose`` returns a ``TreeDrafts`` (each request's drafts in topological order
  with their parents; ``common.engine.spec.tree``): the verify forward attends under the tree's ancestor mask at
  per-draft positions, ``verify.accepted_path`` walks it, and the drafter moves the accepted path's KV to
  consecutive positions right after the forward (before ``trim_verified_kv``; its rows are not a prefix).
- Hidden-state drafters (EAGLE, EAGLE3) read the target's hidden states of every forward through the model
  runner's ``spec_hook`` (``ModelRunner.set_spec_hook``), right after sampling: all rows' features (EAGLE3: the
  captured layer inputs) and the sampled tokens; the drafter runs its own extend over the committed rows there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from common.engine.forward_batch import ForwardBatch
    from common.engine.req import Req
    from common.engine.schedule_batch import ModelWorkerBatch
    from common.engine.spec.tree import TreeDrafts


@dataclass(frozen=True)
class DraftHandoff:
    """A request's draft state after its prompt, from a P/D prefill node to its decode node (the metadata
    extension of ``kvtransfer.metadata``): EAGLE's top-k at the last prompt position and the head's feature there;
    STANDALONE's count of positions whose draft KV travelled with the target's pages."""

    topk_ids: tuple[int, ...] = ()
    topk_p: tuple[float, ...] = ()
    hidden: bytes = b""  # float32 little-endian
    kv_len: int = 0  # STANDALONE: the draft model's KV of positions [0, kv_len) sits at the target's slots


@dataclass(frozen=True)
class DraftKV:
    """KV a drafter keeps beside the target's under the target's slot numbering (EAGLE's head, a P/D node's
    STANDALONE draft model): in P/D it travels with the target's layers, and both nodes must hold the same
    (``fingerprint``)."""

    # (K, V) buffers [target slots, kv heads, head dim]: heads and head dim may differ from the target's
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    state_dims: tuple[int, int]  # (topk, hidden) of the ``DraftHandoff`` the metadata carries
    fingerprint: dict[str, str]
    total_kv_heads: int = 0  # KV heads of the whole draft (its layers split over TP as the target's); 0: the target's


class Drafter(Protocol):
    def propose(self, reqs: list[Req], caps: list[int]) -> list[list[int]] | TreeDrafts:
        """Draft tokens for each request of a decode step: at most ``caps[i]`` for request i (0: none asked).

        ``reqs[i]``'s tokens so far are ``all_ids()``; the KV of its last token is not written yet.
        """
        ...

    def on_verified(self, req: Req, drafted: int, accepted: int) -> None:
        """The verify of ``drafted`` tokens of ``req`` accepted the first ``accepted`` of them."""
        ...

    def release(self, rows: list[int]) -> None:
        """These request slots were freed: drop what the drafter holds for them (a draft model's KV pages)."""
        ...

    def close(self) -> None:
        """Release what the drafter built (a draft model's pools)."""
        ...

    def handoff(self, row: int) -> DraftHandoff | None:
        """What a P/D decode node needs to draft for request slot ``row`` from its first step (None: nothing)."""
        ...

    def resume(self, row: int, handoff: DraftHandoff) -> None:
        """Request slot ``row`` arrived from a prefill node with ``handoff`` (its KV with it)."""
        ...


class SpecHook(Protocol):
    """What a drafter hands the target's ``ModelRunner`` (``set_spec_hook``): a hidden-state drafter, or a P/D node's
    STANDALONE draft model, which extends over each prefill chunk at the target's slots."""

    capture: frozenset[int]  # target layers whose input streams are the features (EAGLE3); empty: the final hidden

    def after_forward(self, b: ModelWorkerBatch, fb: ForwardBatch, features: torch.Tensor,
                      next_token_ids: torch.Tensor) -> None:
        """A target forward ran: ``features`` [num_tokens, width] of every row, ``next_token_ids`` the sampled tokens
        (one per request; one per row for a verify). Runs on the forward's thread before the results go out."""
        ...
