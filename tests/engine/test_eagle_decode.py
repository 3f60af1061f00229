"""EAGLE / EAGLE3 speculation in one in-process ``Scheduler``: greedy output token for token the output without it,
for chains (topk 1) and trees (topk > 1), through page sizes 1 and 16, chunked prefill and a radix hit; pools back.

Random heads draft what the target rarely says, so these runs check that nothing wrong is accepted; the scripted
trees below put the target's own continuation on a later branch, so accepted paths need their KV moved."""

from __future__ import annotations

from typing import Any

import pytest

from common.engine.sampling.params import SamplingParams
from common.engine.spec.eagle import EagleDrafter
from common.engine.spec.tree import TreeDrafts
from tests.engine.test_eagle_head import head_dir
from tests.engine.test_spec_decode import gen, greedy, prompt, run
from tests.model_fixtures import make_tiny_model


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(make_tiny_model("llama"))


def _reqs() -> list:
    shared = prompt(40, 7)
    return [gen("a", prompt(21, 1), greedy(20)), gen("long", prompt(70, 2), greedy(12)),
            gen("b", shared, greedy(16)), gen("twin", shared, greedy(16))]


def _eagle(kind: str, **kw: Any) -> dict[str, Any]:
    return {"speculative_algorithm": kind, "speculative_draft_model_path": str(head_dir(kind)),
            **{f"speculative_{k}": v for k, v in kw.items()}}


@pytest.mark.parametrize(("kind", "flags", "page_size"), [
    ("EAGLE3", {"num_steps": 3}, 16),
    ("EAGLE", {"num_steps": 2, "eagle_topk": 3, "num_draft_tokens": 5}, 1),
    ("EAGLE3", {"num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 6}, 16),
])
def test_eagle_greedy_output_is_the_plain_output(tiny, kind: str, flags: dict, page_size: int) -> None:
    reqs = _reqs()
    plain, _ = run(tiny, reqs, page_size=page_size, chunked_prefill_size=32)
    spec, _ = run(tiny, reqs, _eagle(kind, **flags), page_size=page_size, chunked_prefill_size=32)
    assert spec.ids == plain.ids
    finals = spec.final.values()
    assert sum(f.spec_draft_tokens for f in finals) > 0
    assert all(f.completion_tokens == len(spec.ids[f.rid]) for f in finals)


def _scripted_trees(plain: dict[str, list[int]], vocab: int):
    """``EagleDrafter.propose`` drafting the target's own next 3 tokens c0 c1 c2 on later branches of a tree::

        root -> w0 -> w2           drafts (parent): w0 (-1), c0 (-1), w2 (0), w3 (1), c1 (1), c2 (4)
             -> c0 -> w3           accepted path: c0, c1, c2 = drafts 1, 4, 5 (KV moved to positions +1 .. +3)
                   -> c1 -> c2
    """

    def propose(self, reqs, caps) -> TreeDrafts:
        tokens, parents = [], []
        for r in reqs:
            c = plain[r.rid][len(r.output_ids):][:3]
            w = [(t + 1 + j) % vocab for j, t in enumerate([*c, *c])]
            t = [w[0], c[0], w[1], w[2], c[1], c[2]] if len(c) == 3 else []
            tokens.append(t)
            parents.append([-1, -1, 0, 1, 1, 4] if t else [])
        return TreeDrafts(tokens, parents)

    return propose


SEEDED = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.95, top_k=40, seed=7, frequency_penalty=0.5,
                        presence_penalty=0.2, repetition_penalty=1.1)


@pytest.mark.parametrize(("page_size", "sampled"), [(1, False), (16, True)])
def test_accepted_tree_paths_off_the_first_branch_keep_the_output(tiny, monkeypatch, page_size: int,
                                                                  sampled: bool) -> None:
    """Every step accepts 3 drafts whose rows are not the first 3: their KV must be moved into place (else the
    next steps attend to the wrong drafts' KV and the output changes); a grammar prunes drafts it refuses. Seeded
    sampling with penalties draws the plain run's tokens: each row samples as if its own path were output."""
    reqs = [*_reqs(), gen("g", prompt(30, 9), greedy(24, regex="(the |cat |dog |a |on ){10,30}"))]
    if sampled:
        reqs = [gen(r.rid, r.input_ids, SEEDED) for r in reqs[:3]]
    plain, _ = run(tiny, reqs, page_size=page_size)
    monkeypatch.setattr(EagleDrafter, "propose", _scripted_trees(plain.ids, 1536))
    spec, _ = run(tiny, reqs, _eagle("EAGLE", num_steps=3, eagle_topk=2, num_draft_tokens=7), page_size=page_size)
    assert spec.ids == plain.ids
    for f in spec.final.values():
        assert f.spec_accepted_tokens >= 3 * (f.spec_verify_ct - 1), (f.rid, f.spec_verify_ct, f.spec_accepted_tokens)


def test_the_heads_state_follows_the_committed_tokens(tiny, monkeypatch) -> None:
    """After every step (three prefill chunks, then verifies accepting off-first-branch paths), the drafter's state
    of the request is what the head computes directly over all its committed tokens: the DRAFT_EXTEND rows pair the
    token after each position with the target's features there (EAGLE3: the captured layer inputs)."""
    import torch

    from common.config import ServerArgs
    from common.engine.scheduler import Scheduler
    from common.engine.spec.eagle_loader import load_eagle_head
    from common.engine.spec.eagle_worker import EagleWorker
    from common.text.tokenizer import load_tokenizer
    from tests.conftest import assert_scheduler_pools_released
    from tests.engine.test_spec_decode import Run
    from tests.model_fixtures import PagedHarness, load_tiny_model

    req = gen("r", prompt(70, 5), greedy(14))
    plain, _ = run(tiny, [req])
    monkeypatch.setattr(EagleDrafter, "propose", _scripted_trees(plain.ids, 1536))
    args = ServerArgs(model_path=tiny, max_total_tokens=2048, max_running_requests=4, disable_overlap_schedule=True,
                      page_size=16, chunked_prefill_size=32,
                      **_eagle("EAGLE3", num_steps=3, eagle_topk=2, num_draft_tokens=7))
    out = Run()
    sched = Scheduler(args, tiny, load_tokenizer(tiny), out.sink)
    target = load_tiny_model("llama")
    head = load_eagle_head(head_dir("EAGLE3"), "EAGLE3", target)
    checked = 0
    try:
        sched.step([req])
        for _ in range(40):
            live = [r for r in sched.decode.running_batch.reqs if r.rid == "r" and r.req_pool_idx is not None
                    and not r.finished()] if sched.decode.running_batch else []
            if live and live[0].output_ids:
                r = live[0]
                drafter = sched.decode.speculator.drafter
                ids, c = r.all_ids(), r.kv_committed_len
                h = PagedHarness(target, page_size=16, num_pages=16)
                h.add("x")
                h.forward([("x", ids[:c])])
                fb = h.last_batch
                fb.attn_metadata = None
                with torch.inference_mode():
                    feats = target.forward_capture(fb, head.config.capture)[1]
                    worker = EagleWorker(head, 16, 16, 1, 2, 3, 7)
                    want = worker.extend(torch.tensor(ids[1 : c + 1]), feats, torch.tensor([h.reqs["x"].row]), [0],
                                         [c], h.req_to_token)
                row = r.req_pool_idx
                assert drafter.ready[row]
                assert torch.equal(drafter.state.topk_ids[row], want.topk_ids[0]), (c, len(r.output_ids))
                assert (drafter.state.hidden[row] - want.hidden[0]).abs().max() < 1e-3
                checked += 1
            if sched.is_idle():
                break
            sched.step([])
        assert_scheduler_pools_released(sched)
    finally:
        sched.close()
    assert out.ids["r"] == plain.ids["r"]
    assert checked >= 3 and out.final["r"].spec_accepted_tokens >= 9


def test_retracted_requests_recompute_their_heads_state(tiny) -> None:
    """Over-committed admission forces retractions: a retracted request's state is dropped with its slot and rebuilt
    by its recomputed prefill; outputs and pools as without speculation."""
    reqs = [gen(f"r{i}", prompt(20 + 8 * i, 10 + i), greedy(28)) for i in range(5)]
    small = {"max_total_tokens": 400, "page_size": 16, "together": True, "schedule_conservativeness": 0.05}
    plain, _ = run(tiny, reqs, **small)
    spec, sched = run(tiny, reqs, _eagle("EAGLE3", num_steps=2, eagle_topk=2, num_draft_tokens=4), **small)
    assert sched.decode.num_retracted > 0, "the KV budget was meant to force a retraction"
    assert spec.ids == plain.ids
