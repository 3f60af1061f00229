"""The sampler's draws without a full sort (``top_k_sorted``, ``draw_in_window``): each gives the token the full
stable sort gives, whichever path a batch takes (CPU, no model)."""

from __future__ import annotations

import pytest
import torch

from common.engine.sampling import sampler as sampler_module
from common.engine.sampling.sampler import Sampler, SamplingBatchInfo, draw_in_window, top_k_sorted
from tests.sampling_helpers import make_req


# -- top-k without a full sort -----------------------------------------------------------------------------------------
def _tied_probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows of few distinct values (many ties, zeros included) next to plain random rows."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randint(0, 4, (rows, vocab), generator=g).float()
    probs = torch.cat([coarse, torch.rand(rows, vocab, generator=g)]).pow(3)
    return probs / probs.sum(-1, keepdim=True)


def test_top_k_sorted_is_the_stable_sort_cut_to_k() -> None:
    """Ties inside the first k (kept in id order), ties at the k-th value (the lowest ids win), zeros and plain rows."""
    g = torch.Generator().manual_seed(0)
    tops = _tied_probs(8, 200, seed=0)
    levels = torch.tensor([4.0, 4.0, 3.0, 3.0, 3.0, 2.5, 2.0, 2.0, 1.5, 1.2])  # > any rand(): a strict boundary at 10
    for row in tops[:8]:
        row[torch.randperm(200, generator=g)[:10]] = levels
    probs = tops / tops.sum(-1, keepdim=True)
    full_vals, full_ids = probs.sort(dim=-1, descending=True, stable=True)
    for k in (1, 3, 5, 6, 7, 10, 40, 150):
        for rows in (slice(None), slice(0, 8), slice(8, None)):  # all; the leveled rows; the plain random rows
            vals, ids = top_k_sorted(probs[rows], k)
            assert torch.equal(ids, full_ids[rows, :k]), (k, rows)
            assert torch.equal(vals, full_vals[rows, :k]), (k, rows)


def test_fast_top_k_draws_the_full_sort_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same batch through ``top_k_sorted`` and through the full sort: the same token on every row and step."""
    vocab, g = 2048, torch.Generator().manual_seed(1)
    kinds = [{"top_k": 5}, {"top_k": 40, "top_p": 0.7}, {"top_k": 12, "min_p": 0.05, "temperature": 0.7},
             {"top_k": 64, "top_p": 0.95, "temperature": 1.3}, {"temperature": 0.0}]
    reqs = [make_req(f"r{i}", seed=i if i % 3 else None, **kinds[i % len(kinds)]) for i in range(40)]
    for step in range(8):
        for r in reqs:
            r.output_ids = [1] * step
        if step % 2:  # coarse: ties at the k-th value (the full sort), else distinct values (k columns only)
            logits = torch.randint(0, 6, (len(reqs), vocab), generator=g).float()
        else:
            logits = torch.randn(len(reqs), vocab, generator=g) * 3
        fast = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
        assert fast.sort_width == 64
        with monkeypatch.context() as m:
            m.setattr(sampler_module, "FAST_TOP_K_RATIO", vocab + 1)
            full = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
        assert full.sort_width == vocab
        assert torch.equal(Sampler(seed=step)(logits, fast).next_token_ids,
                           Sampler(seed=step)(logits, full).next_token_ids)


def test_seeded_top_k_row_is_the_same_whichever_path_its_batch_takes() -> None:
    """A seeded top-k row alone (k columns), beside a wider top-k (64 columns) and beside a row with no top-k
    (full sort): the same tokens."""
    vocab = 512
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    runs = []
    for other in (None, {"top_k": 16}, {"top_p": 0.9}):
        target = make_req("t", top_k=6, top_p=0.9, seed=77)
        reqs = [target] + ([make_req("o", **other)] if other else [])
        info = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
        widths = {None: 6, "top_k": 16, "top_p": vocab}
        assert info.sort_width == widths[next(iter(other)) if other else None]
        for _ in range(30):
            ids = Sampler(seed=len(runs))(torch.stack([row] * len(reqs)), info).next_token_ids
            for r, t in zip(reqs, ids.tolist(), strict=True):
                r.output_ids.append(t)
            info.cumulate_output_tokens(ids)
        runs.append(target.output_ids)
    assert len(set(runs[0])) > 1 and runs[0] == runs[1] == runs[2]


def test_window_draw_is_the_full_sort_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches without top-k (plain, top-p, min-p rows; peaked and flat logits): the 256-token window gives the full
    sort's token on every row, and on peaked logits it decides alone (no fallback)."""
    vocab, g = 8192, torch.Generator().manual_seed(2)
    kinds = [{"temperature": 0.7}, {"top_p": 0.9}, {"top_p": 0.5, "temperature": 1.3}, {"min_p": 0.05},
             {"temperature": 1.0}, {"temperature": 0.0}]
    reqs = [make_req(f"r{i}", seed=i if i % 2 else None, **kinds[i % len(kinds)]) for i in range(48)]
    decided = 0
    for step, scale in enumerate([8.0, 6.0, 0.3, 8.0, 1.0, 6.0]):
        for r in reqs:
            r.output_ids = [1] * step
        logits = torch.randn(len(reqs), vocab, generator=g) * scale
        window = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
        assert window.window_width == 256
        with monkeypatch.context() as m:
            m.setattr(sampler_module, "SORT_WINDOW", vocab)
            full = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
        assert full.window_width == 0
        assert torch.equal(Sampler(seed=step)(logits, window).next_token_ids,
                           Sampler(seed=step)(logits, full).next_token_ids), step
        rows = window.sampled_index
        probs = torch.softmax(logits[rows] / window.temperatures.unsqueeze(1), dim=-1)
        u = Sampler(seed=step)._uniforms(window, probs.device)
        decided += draw_in_window(probs, window, u, 256) is not None
        if scale == 0.3:  # flat: the draw's mass reaches past 256 tokens
            assert draw_in_window(probs, window, u, 256) is None
    assert decided >= 3  # the peaked steps
