"""``EagleWorker``: DRAFT_EXTEND over a prompt's target features, then a batched top-k tree draft whose branches each
attend only to their own ancestors, against the head run one row at a time down each path."""

from __future__ import annotations

import pytest
import torch

from common.engine.spec.eagle_loader import load_eagle_head
from common.engine.spec.eagle_worker import EagleWorker
from tests.engine.test_eagle_head import PAGE, _head_batch, head_dir
from tests.model_fixtures import PagedHarness, load_tiny_model

PROMPTS = ([(13 * i) % 900 + 7 for i in range(11)], [(29 * i) % 800 + 3 for i in range(6)])


def _features(model, fb, kind: str) -> torch.Tensor:
    fb.attn_metadata = None
    if kind == "EAGLE3":
        return model.forward_capture(fb, frozenset({1, 2, 3}))[1]
    return model(fb)


def _reference_score(head, pool_pages: int, prompt: list[int], verified: int, feats: torch.Tensor,
                     path: list[int]) -> float:
    """The draft probability of ``path`` (target ids) after the prompt: the head's extend over the prompt rows, then
    one decode row per path token fed the previous row's feature (a fresh pool, one request, no branches)."""
    from common.engine.mem.kv_pool import MHATokenToKVPool

    lc = head.config.layer
    pool = MHATokenToKVPool(pool_pages, PAGE, torch.float32, lc.num_kv_heads, lc.head_dim, 1)
    logit_h, feat = head(_head_batch(head, pool, [*prompt[1:], verified], 0), feats)
    score, h, pos = 1.0, logit_h[-1:], len(prompt)
    for t in path:
        probs = torch.softmax(head.compute_logits(h), -1)[0]
        draft_id = t if head.hot_token_ids is None else int((head.hot_token_ids == t).nonzero())
        score *= float(probs[draft_id])
        h, nxt = head(_head_batch(head, pool, [t], pos), feat[-1:])
        feat, pos = nxt, pos + 1
    return score


@pytest.mark.parametrize(("kind", "topk", "steps", "n"), [("EAGLE3", 3, 4, 12), ("EAGLE", 2, 3, 6)])
def test_tree_draft_matches_each_path_run_alone(kind: str, topk: int, steps: int, n: int) -> None:
    """Two requests (prompts of 11 and 6 tokens, page size 4): every kept node's draft score equals the product
    of the head's probabilities along its path computed without branches, and the tree keeps the best ones."""
    target = load_tiny_model("llama")
    head = load_eagle_head(head_dir(kind), kind, target)
    h = PagedHarness(target, page_size=PAGE, num_pages=32)
    feats, verified = [], []
    for i, prompt in enumerate(PROMPTS):
        h.add(str(i))
        logits = h.forward([(str(i), prompt)])[0]
        feats.append(_features(target, h.last_batch, kind))
        verified.append(int(logits[-1].argmax()))
    worker = EagleWorker(head, num_pages=32, page_size=PAGE, max_batch=4, topk=topk, num_steps=steps,
                         num_draft_tokens=n)
    rows = torch.tensor([h.reqs["0"].row, h.reqs["1"].row])
    lens = [len(p) for p in PROMPTS]
    ids = torch.tensor([t for p, v in zip(PROMPTS, verified, strict=True) for t in [*p[1:], v]])
    state = worker.extend(ids, torch.cat(feats), rows, [0, 0], lens, h.req_to_token)
    tree = worker.draft(state, torch.tensor(verified), rows, lens, h.req_to_token)
    assert tree.tokens.shape == (2, n) and tree.tokens[:, 0].tolist() == verified
    assert tree.scores is not None and int(tree.depths.max()) <= steps
    with torch.inference_mode():
        for b in range(2):
            for j in range(1, n):
                path = [int(tree.tokens[b, a]) for a in tree.mask[b, j].nonzero().flatten().tolist()[1:]]
                want = _reference_score(head, 32, PROMPTS[b], verified[b], feats[b], path)
                assert abs(float(tree.scores[b, j]) - want) <= 1e-4 * max(want, 1e-3), (b, j, path)
    # the root's children are the head's top-k after the prompt (at least the best one is kept)
    assert set(tree.tokens[:, 1].tolist()) <= set(state.topk_ids.flatten().tolist())
