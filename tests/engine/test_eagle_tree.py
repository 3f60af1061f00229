"""EAGLE's draft tree: building it from top-k draft steps, attending over it in one verify forward, verifying it
(greedy and by tree rejection sampling) and compacting the accepted path's KV."""

from __future__ import annotations

import pytest
import torch

from common.engine.kernels.extend_attention import extend_attention_ref
from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.spec.eagle_tree import DraftLevels, DraftTree, ancestor_mask, build_tree
from common.engine.spec.path_kv import compact_path_kv, path_moves
from common.engine.spec.verify import accepted_path
from tests.model_fixtures import PagedHarness, hf_logits, load_tiny_model, make_tiny_model


def _random_levels(bs: int, k: int, steps: int, vocab: int, seed: int) -> tuple[DraftLevels, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    levels = DraftLevels(k)
    inputs = []
    for i in range(steps):
        rows = bs if i == 0 else bs * k
        probs = torch.softmax(3 * torch.randn(rows, vocab, generator=gen), -1)
        p, ids = probs.topk(k, -1)
        levels.add_step(p, ids)
        inputs.append(ids)
    return levels, inputs


def test_build_tree_keeps_the_best_paths() -> None:
    """Against a brute force over every candidate path: the kept nodes are the n - 1 best path scores, each
    node's parent is the candidate it was drafted from, and the mask is exactly the ancestors."""
    bs, k, steps, n = 2, 3, 3, 9
    levels, _ = _random_levels(bs, k, steps, vocab=40, seed=1)
    tree = build_tree(torch.tensor([7, 8]), levels, n)
    scores = torch.cat(levels.scores, 1)
    parents = torch.cat(levels.parents, 1)
    for b in range(bs):
        best = sorted(range(scores.shape[1]), key=lambda f: -float(scores[b, f]))[: n - 1]
        kept = sorted(best)
        assert tree.tokens[b, 1:].tolist() == [int(torch.cat(levels.tokens, 1)[b, f]) for f in kept]
        for node, f in enumerate(kept, start=1):
            pf = int(parents[b, f])
            assert int(tree.parents[b, node]) == (0 if pf < 0 else kept.index(pf) + 1)
        for j in range(n):
            anc, cur = {j}, j
            while int(tree.parents[b, cur]) >= 0:
                cur = int(tree.parents[b, cur])
                anc.add(cur)
            assert set(tree.mask[b, j].nonzero().flatten().tolist()) == anc
            assert int(tree.depths[b, j]) == len(anc) - 1
    assert tree.positions(torch.tensor([10, 20])).view(bs, n)[:, 0].tolist() == [10, 20]


def test_build_tree_ties_keep_parents() -> None:
    """Probability-1 drafts make a child's score equal its parent's: the tie goes to the parent."""
    levels = DraftLevels(2)
    levels.add_step(torch.tensor([[1.0, 0.0]]), torch.tensor([[5, 6]]))
    levels.add_step(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([[7, 8], [9, 10]]))
    tree = build_tree(torch.tensor([1]), levels, 3)
    assert tree.tokens.tolist() == [[1, 5, 7]] and tree.parents.tolist() == [[-1, 0, 1]]


def _tree_batch(page_size: int, window: int | None, seed: int):
    """A pool with 3 requests (prefix 5, 17, 0) each extended by a random tree; q and the new K/V random."""
    gen = torch.Generator().manual_seed(seed)
    prefix, ext = [5, 17, 0], [6, 4, 3]
    kvh, heads, d = 2, 4, 16
    num_pages = sum(-(-(p + e) // page_size) for p, e in zip(prefix, ext, strict=True)) + 2
    pool = MHATokenToKVPool(num_pages, page_size, torch.float32, kvh, d, 1)
    pool.k_buffer[0].normal_(generator=gen)
    pool.v_buffer[0].normal_(generator=gen)
    r2t = torch.zeros(4, 32, dtype=torch.int64)
    pages = list(range(1, num_pages + 1))
    masks, positions = [], []
    for i, (p, e) in enumerate(zip(prefix, ext, strict=True)):
        mine = [pages.pop() for _ in range(-(-(p + e) // page_size))]
        pos = torch.arange(p + e)
        r2t[i + 1, : p + e] = torch.tensor(mine)[pos // page_size] * page_size + pos % page_size
        parents = torch.tensor([[-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, e)]])
        mask = ancestor_mask(parents, e)[0]
        masks.append(mask.reshape(-1))
        positions.append(p + mask.sum(1) - 1)
    q = torch.randn(sum(ext), heads, d, generator=gen)
    return pool, r2t, torch.arange(1, 4), prefix, ext, q, torch.cat(masks), torch.cat(positions)


@pytest.mark.parametrize(("page_size", "window"), [(1, None), (16, None), (4, 3)])
def test_tree_attention_torch_matches_dense(page_size: int, window: int | None) -> None:
    """The torch backend's tree form against the dense oracle; the oracle's tree form against a plain causal
    attention for a chain (a chain's ancestor mask is causal)."""
    from common.engine.forward_batch import ForwardBatch, ForwardMode
    from common.engine.model.attention import TorchAttentionBackend

    pool, r2t, rpi, prefix, ext, q, mask, positions = _tree_batch(page_size, window, seed=page_size)
    seq = [p + e for p, e in zip(prefix, ext, strict=True)]
    out_loc = torch.cat([r2t[i + 1, p:s] for i, (p, s) in enumerate(zip(prefix, seq, strict=True))])
    backend = TorchAttentionBackend(4, 2, 16, window)
    fb = ForwardBatch(
        ForwardMode.EXTEND, 3, torch.zeros(sum(ext), dtype=torch.int64), positions, out_loc, rpi,
        torch.tensor(seq), torch.tensor(ext), torch.tensor(prefix), r2t, seq, ext, prefix, pool, backend,
        custom_mask=mask,
    )
    backend.init_forward_metadata(fb)
    k_new, v_new = pool.k_buffer[0][out_loc].clone(), pool.v_buffer[0][out_loc].clone()
    out = backend.forward(q, k_new, v_new, 0, fb).view_as(q)
    ref = extend_attention_ref(q, pool.k_buffer[0], pool.v_buffer[0], r2t, rpi, prefix, ext, 0.25, window, mask,
                               positions)
    assert (out - ref).abs().max() < 1e-5
    causal = extend_attention_ref(q, pool.k_buffer[0], pool.v_buffer[0], r2t, rpi, prefix, ext, 0.25, window)
    assert (ref - causal).abs().max() > 1e-3, "the tree changed nothing: the test would not see a causal mask"
    if window is not None:  # the tree form has no window among the new tokens
        return
    chain = torch.cat([torch.tril(torch.ones(e, e, dtype=torch.bool)).reshape(-1) for e in ext])
    chain_pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext, strict=True)])
    same = extend_attention_ref(q, pool.k_buffer[0], pool.v_buffer[0], r2t, rpi, prefix, ext, 0.25, window, chain,
                                chain_pos)
    assert (same - causal).abs().max() < 1e-6


def test_tree_verify_forward_matches_each_path() -> None:
    """One verify forward over a tree (page size 16, the tree crossing a page) gives node j the target's logits
    after the prompt plus j's path, as a plain forward of that sequence does (HF's, the oracle)."""
    model = load_tiny_model("llama")
    h = PagedHarness(model, page_size=16)
    prompt = [(11 * i) % 700 + 5 for i in range(13)]
    h.add("a")
    h.forward([("a", prompt)])
    parents = [-1, 0, 0, 1, 1, 3, 2]
    tokens = [prompt[-1] + 1, 21, 22, 23, 24, 25, 26]
    mask = ancestor_mask(torch.tensor([parents]), len(parents))[0]
    depth = (mask.sum(1) - 1).tolist()
    logits = h.forward([("a", tokens)], positions=[len(prompt) + dd for dd in depth], custom_mask=mask.reshape(-1))[0]
    path_dir = make_tiny_model("llama")
    for j in range(len(tokens)):
        path = [tokens[a] for a in mask[j].nonzero().flatten().tolist()]
        want = hf_logits(path_dir, prompt + path)[-1]
        assert (logits[j] - want).abs().max() < 1e-3, f"node {j}"


def test_tree_verify_preserves_the_target_distribution() -> None:
    """A sampled target token at every node, on a 4-token vocab, 20000 trials: the first emitted token follows the
    root's target distribution, after an accepted child c the next follows c's, whatever the drafts (2 and 0 under
    the root, 3 under the first), and the accepted lengths are what those laws give."""
    trials = 20000
    tokens, parents = [2, 0, 3], [-1, -1, 0]
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.1, 0.3], [0.25] * 4, [0.7, 0.1, 0.1, 0.1]])
    sampled = torch.multinomial(q, trials, replacement=True, generator=torch.Generator().manual_seed(0)).T.tolist()
    emitted, accepted = [], []
    for targets in sampled:  # targets[0] at the root, targets[j + 1] at draft j
        path = accepted_path(targets, tokens, parents)
        emitted.append([targets[0]] + [targets[j + 1] for j in path])
        accepted.append(len(path))
    _assert_distribution(torch.tensor([e[0] for e in emitted]), q[0])
    _assert_distribution(torch.tensor([e[1] for e in emitted if e[0] == 2]), q[1])
    _assert_distribution(torch.tensor(accepted), torch.tensor([0.6, 0.3 * 0.7 + 0.1, 0.3 * 0.3]))


def _assert_distribution(samples: torch.Tensor, p: torch.Tensor) -> None:
    n = len(samples)
    freq = torch.bincount(samples, minlength=len(p)).double() / n
    sd = torch.sqrt(p.double() * (1 - p.double()) / n)
    assert ((freq - p.double()).abs() <= 5 * sd + 1e-9).all(), f"frequencies {freq.tolist()} vs {p.tolist()}"


@pytest.mark.parametrize("page_size", [1, 4])
def test_compact_path_kv_moves_the_path_into_place(page_size: int) -> None:
    """Two requests' verify rows (root + 4 drafts each); paths (1, 2, 3) and (0, 3): each path draft's KV ends at
    the rows right after the root, in every layer, and nothing else changes."""
    pool = MHATokenToKVPool(16, page_size, torch.float32, 1, 2, 2)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view_as(buf))
    before = [buf.clone() for buf in (*pool.k_buffer, *pool.v_buffer)]
    slots = [[page_size + i for i in range(5)], [page_size + 8 + i for i in range(5)]]
    paths = [[1, 2, 3], [0, 3]]
    src, dst = [], []
    for row, path in zip(slots, paths, strict=True):
        s, d = path_moves(row, path)
        src += s
        dst += d
    assert len(src) == 4  # draft 0 of the second request is in place already
    compact_path_kv([pool], src, dst)
    for buf, old in zip((*pool.k_buffer, *pool.v_buffer), before, strict=True):
        for row, path in zip(slots, paths, strict=True):
            for i, j in enumerate(path):
                assert torch.equal(buf[row[1 + i]], old[row[1 + j]])
        untouched = torch.ones(buf.shape[0], dtype=torch.bool)
        untouched[dst] = False
        assert torch.equal(buf[untouched], old[untouched])


def test_chain_is_a_linear_draft() -> None:
    tree = DraftTree.chain(torch.tensor([[4, 5, 6]]))
    assert tree.parents.tolist() == [[-1, 0, 1]] and tree.depths.tolist() == [[0, 1, 2]]
    assert torch.equal(tree.mask[0], torch.tril(torch.ones(3, 3, dtype=torch.bool)))


class _EvenSums:
    """A fake grammar: a token is allowed iff the running sum stays even; a mask row records the sum there."""

    def __init__(self) -> None:
        self.stack = [0]

    def accept(self, token: int) -> bool:
        if (self.stack[-1] + token) % 2:
            return False
        self.stack.append(self.stack[-1] + token)
        return True

    def rollback(self, n: int) -> None:
        del self.stack[len(self.stack) - n :]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].fill_(self.stack[-1])


def test_tree_grammar_masks_prune_refused_subtrees() -> None:
    """Each kept row's mask is the grammar's state after its path; a draft refused at its parent goes with its
    subtree; the matcher ends where it started. ``limit_depth`` keeps what a request's cap allows."""
    from types import SimpleNamespace

    from common.engine.spec.tree import limit_depth, tree_grammar_masks, tree_positions_and_mask

    tokens, parents = [2, 3, 4, 6, 1, 8], [-1, -1, 0, 0, 1, 2]  # 3 (odd) is refused: it and its child 1 go
    g = _EvenSums()
    masks, kept_t, kept_p = tree_grammar_masks(SimpleNamespace(grammar=g), tokens, parents, 64)
    assert (kept_t, kept_p) == ([2, 4, 6, 8], [-1, 0, 0, 1])
    assert masks[:, 0].tolist() == [0, 2, 6, 8, 14]  # root, then the running sums of the kept paths
    assert g.stack == [0]
    assert limit_depth(tokens, parents, 2) == ([2, 3, 4, 6, 1], [-1, -1, 0, 0, 1])
    positions, mask = tree_positions_and_mask([10], [(kept_t, kept_p)])
    assert positions == [10, 11, 12, 12, 13]
    assert mask.view(5, 5)[4].tolist() == [True, True, True, False, True]
