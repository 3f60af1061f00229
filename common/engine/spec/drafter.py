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
- Tree drafts (topk > 1, EAGLE): a drafter would return each request's nodes in topological order with their
  parents; ``verify.accepted_path`` already walks a tree, while the verify forward needs the tree mask and per-node
  positions from the attention backends, and the accepted path's KV must be moved into place before
  ``trim_verified_kv`` (its rows are not a prefix of the request's rows).
- Hidden-state drafters (EAGLE, EAGLE3) read the target's hidden states: the verify's at every position (the model
  runner computes them for the logits of every position, ``ForwardMode.logits_at_every_token``; handing them out
  with the batch result is that drafter's addition) and the prefill's; they would receive them with
  ``on_verified`` and a prefill hook of their own, and a P/D prefill node would send the prompt's last hidden state
  beside the KV as a versioned metadata extension.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from common.engine.req import Req


class Drafter(Protocol):
    def propose(self, reqs: list[Req], caps: list[int]) -> list[list[int]]:
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
