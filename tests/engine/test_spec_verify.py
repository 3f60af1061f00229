"""Speculative decoding's parts on synthetic inputs: the accept rule (linear and tree), that sampled verification keeps
the target's token distribution (a chi-square test on a 4-token vocabulary), the n-gram drafter's lookup and its
adaptive budget, and the flags' refusals."""

from __future__ import annotations

import pytest
import torch

from common.config import ServerArgs
from common.engine.req import Req
from common.engine.sampling.params import SamplingParams
from common.engine.sampling.sampler import Sampler, SamplingBatchInfo
from common.engine.spec import ngram
from common.engine.spec.info import VerifyInput
from common.engine.spec.ngram import NgramDrafter
from common.engine.spec.verify import accept_length, accepted_path
from common.errors import ConfigError


def test_accept_length_counts_leading_drafts_the_target_sampled_before_them() -> None:
    assert accept_length([5, 6, 7, 8], [5, 6, 7]) == 3
    assert accept_length([5, 9, 7, 8], [5, 6, 7]) == 1  # d2 != t_1: d3 is not looked at
    assert accept_length([4, 6, 7, 8], [5, 6, 7]) == 0
    assert accept_length([4], []) == 0


def test_a_tree_accepts_the_child_matching_the_target_at_each_node() -> None:
    #        root -> 0:a -> 2:c
    #             -> 1:b -> 3:d -> 4:e
    tokens, parents = [10, 11, 12, 13, 14], [-1, -1, 0, 1, 3]
    targets = [11, 0, 13, 0, 99, 0]  # targets[n + 1] is at node n: root -> b (1), 1 -> d (3), 3 -> 99: no child
    assert accepted_path(targets, tokens, parents) == [1, 3]
    assert accepted_path([12, 0, 0, 0, 0, 0], tokens, parents) == []
    chain = [1, 2, 3]
    assert accepted_path([1, 2, 9, 9], chain, [-1, 0, 1]) == list(range(accept_length([1, 2, 9, 9], chain)))


# -- sampled verification keeps the target's distribution ---------------------------------------------------------
V, TRIALS, TEMP, TOP_K = 4, 12000, 0.8, 3
LOGITS0 = torch.tensor([1.0, 0.2, -0.5, 0.6])
LOGITS1 = torch.tensor([[0.1, 1.2, -0.3, 0.0], [0.9, -0.2, 0.4, 0.3], [0.0, 0.0, 1.5, -1.0], [-0.6, 0.8, 0.2, 0.5]])
LOGITS2 = torch.tensor([0.3, -0.4, 0.8, 0.1])  # the third position's; only its row shape matters here


def target_probs(logits: torch.Tensor) -> torch.Tensor:
    """What the sampler draws from: temperature, then the top-k tokens renormalised."""
    p = torch.softmax(logits / TEMP, dim=-1)
    keep = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, p.topk(TOP_K, dim=-1).indices, True)
    p = p * keep
    return p / p.sum(-1, keepdim=True)


def sample_pairs(accept_all: bool) -> torch.Tensor:
    """The first two tokens each trial emits, drafting two tokens from a distribution unlike the target's and
    verifying them as a TARGET_VERIFY step does; a trial that emits one token draws its second as a decode step."""
    gen = torch.Generator().manual_seed(7)
    drafts = torch.multinomial(torch.tensor([0.05, 0.05, 0.1, 0.8]), 2 * TRIALS, True, generator=gen)
    drafts = drafts.view(TRIALS, 2).tolist()
    params = SamplingParams(temperature=TEMP, top_k=TOP_K)
    reqs = [Req(f"t{i}", [1, 2], params) for i in range(TRIALS)]
    spec = VerifyInput(drafts, [None] * TRIALS, drafter=None, offsets=[3 * i for i in range(TRIALS)])  # type: ignore[arg-type]
    logits = torch.stack([torch.stack([LOGITS0, LOGITS1[d[0]], LOGITS2]) for d in drafts]).view(-1, V)
    sampler = Sampler(seed=11)
    tokens = sampler(logits, SamplingBatchInfo.from_reqs(spec.sampling_rows(reqs), V, "cpu")).next_token_ids.tolist()
    out = torch.empty(TRIALS, 2, dtype=torch.int64)
    single = []
    for i in range(TRIALS):
        rows = range(3 * i, 3 * i + 3) if accept_all else spec.accepted_rows(i, tokens)
        emitted = [tokens[r] for r in rows] if not accept_all else [drafts[i][0], drafts[i][1]]
        out[i, : min(2, len(emitted))] = torch.tensor(emitted[:2])
        if len(emitted) == 1:
            single.append(i)
    if single:
        second = sampler(LOGITS1[out[single, 0]], SamplingBatchInfo.from_reqs([reqs[i] for i in single], V, "cpu"))
        out[single, 1] = second.next_token_ids
    return out


def chi_square(pairs: torch.Tensor) -> float:
    expected = (target_probs(LOGITS0)[:, None] * target_probs(LOGITS1)).view(-1) * TRIALS
    observed = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()
    seen = expected > 0
    if observed[~seen].sum() > 0:  # a token outside the target's top-k was emitted
        return float("inf")
    return float(((observed[seen] - expected[seen]) ** 2 / expected[seen]).sum())


def test_sampled_verification_emits_the_targets_distribution() -> None:
    # 9 of 16 cells are possible (top-3 of 4 twice): 8 degrees of freedom, chi2 > 26.1 has p < 0.001.
    assert chi_square(sample_pairs(accept_all=False)) < 26.1
    assert chi_square(sample_pairs(accept_all=True)) > 1000  # a verifier that takes every draft emits q's


# -- the n-gram drafter -------------------------------------------------------------------------------------------
def req_with(tokens: list[int], n_prompt: int) -> Req:
    req = Req("r", tokens[:n_prompt], SamplingParams(max_new_tokens=64))
    req.output_ids = tokens[n_prompt:]
    return req


def test_ngram_drafts_what_followed_the_longest_earlier_match_then_repeats_its_period() -> None:
    drafter = NgramDrafter(draft_len=6, min_window=2, max_window=4)
    #           0  1  2  3  4  5  6  7  8  9 10
    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2]  # suffix "1 2" also ends at 2 and 6, neither a 3-gram match
    req = req_with(tokens, 5)
    assert drafter.propose([req], [3]) == [[4, 8, 1]]
    cycle = [5, 6, 7, 5, 6, 7, 5]  # suffix "7 5" ends at 3 and 6; continuation runs into the suffix: periodic
    assert drafter.propose([req_with(cycle, 3)], [6]) == [[6, 7, 5, 6, 7, 5]]
    assert drafter.propose([req_with([1, 2, 3, 4], 4)], [4]) == [[]]  # no earlier occurrence
    longest = [1, 2, 3, 0, 2, 3, 5, 1, 2, 3]  # "2 3" at 2 and 5; "1 2 3" only at 2: the longer match wins
    assert drafter.propose([req_with(longest, 10)], [2]) == [[0, 2]]


def test_ngram_budget_follows_acceptance_and_pauses_after_misses(monkeypatch) -> None:
    monkeypatch.setattr(ngram, "VERIFY_COST", 0.0)  # every draft is verified (the gate: the next test)
    drafter = NgramDrafter(draft_len=8, min_window=1, max_window=4)
    req = req_with([1, 2, 1, 2, 1, 2, 1], 7)
    assert len(drafter.propose([req], [8])[0]) == 8
    drafter.on_verified(req, 8, 2)
    assert len(drafter.propose([req], [8])[0]) == 5  # 2 * accepted + 1
    drafter.on_verified(req, 5, 5)
    assert len(drafter.propose([req], [8])[0]) == 8  # doubled, capped at the draft length
    drafter.on_verified(req, 8, 0)  # a miss: one step without drafts
    assert drafter.propose([req], [8]) == [[]]
    assert drafter.propose([req], [8]) == [[2]]
    drafter.on_verified(req, 1, 0)  # two misses in a row: two steps without drafts
    assert drafter.propose([req], [8]) == [[]] and drafter.propose([req], [8]) == [[]]
    assert drafter.propose([req], [8]) == [[2]]
    drafter.on_verified(req, 1, 0)  # three: four
    assert [drafter.propose([req], [8]) for _ in range(5)] == [[[]]] * 4 + [[[2]]]
    assert drafter.propose([req], [0]) == [[]]  # no cap, no draft


def test_a_step_verifies_only_drafts_expected_to_pay_for_it() -> None:
    drafter = NgramDrafter(draft_len=8, min_window=1, max_window=4)
    looping = req_with([1, 2, 1, 2, 1, 2, 1], 7)
    others = [req_with([10 + i, 20 + i, 30 + i], 3) for i in range(7)]  # nothing to draft
    batch = [looping, *others]
    assert drafter.propose(batch, [8] * 8)[0] == [2, 1, 2, 1, 2, 1, 2, 1]  # 8 tokens at rate 1: one per request
    drafter.on_verified(looping, 8, 3)  # rate 0.69, budget 7: 4.8 expected tokens for 8 requests
    assert drafter.propose(batch, [8] * 8) == [[]] * 8
    state = looping.spec_state
    assert state.rate == pytest.approx(0.6875 + ngram.REGAIN * 0.3125)  # a waiting draft regains rate
    assert len(drafter.propose([looping], [8])[0]) == 7  # alone, the same draft pays for its verify


# -- flags ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("changes", "message"), [
    ({"speculative_num_steps": 3}, "--speculative-num-steps needs --speculative-algorithm"),
    ({"speculative_algorithm": "EAGLE"}, "EAGLE needs --speculative-draft-model-path .a local EAGLE draft head"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4}, "tree drafts are EAGLE's"),
    ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/h", "speculative_eagle_topk": 2,
      "speculative_num_steps": 2, "speculative_num_draft_tokens": 8}, "exceeds the 7 nodes"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3, "speculative_num_draft_tokens": 5},
     "must be --speculative-num-steps \\+ 1"),
    ({"speculative_algorithm": "STANDALONE"}, "needs --speculative-draft-model-path"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "/m"}, "NGRAM drafts without a model"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/m",
      "speculative_ngram_max_match_window_size": 4}, "is for --speculative-algorithm NGRAM"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5,
      "speculative_ngram_max_match_window_size": 4}, "must be <="),
    ({"speculative_algorithm": "NGRAM", "disaggregation_mode": "prefill"}, "give it to decode nodes"),
    ({"speculative_algorithm": "NGRAM", "enable_overlap_schedule": True},
     "a colocated node speculates without the overlap schedule .a step's drafts need the previous step's accepted "
     "tokens, known only once that step ran.; drop --enable-overlap-schedule"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/m", "disaggregation_mode": "decode",
      "enable_overlap_schedule": True}, "--enable-overlap-schedule: a decode node speculates without"),
])
def test_speculative_flags_that_do_not_go_together_are_refused(changes, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerArgs(**changes)
