"""Sampling: parameter validation, the batched sampler and penalties (CPU, no model; stops: test_stop_conditions)."""

from __future__ import annotations

import math

import pytest
import torch

from common.engine.req import Req
from common.engine.sampling.params import SamplingParams
from common.engine.sampling.penalties import PenaltyState
from common.engine.sampling.sampler import Sampler, SamplingBatchInfo
from common.errors import InvalidRequestError
from tests.sampling_helpers import EOS, V, empirical, make_req, sample

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOG_PROBS = PROBS.log()


# -- SamplingParams.verify -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"stop_token_ids": (5, V)}, "stop_token_ids"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop"),
        ({"stop": tuple(f"s{i}" for i in range(33))}, "stop"),
        ({"stop": ("x" * 300,)}, "stop"),
        ({"seed": 2**64}, "seed"),
        ({"top_k": 2.5}, "top_k"),
    ],
)
def test_verify_rejects_and_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs).verify(vocab_size=V)


def test_verify_message_says_what_to_fix() -> None:
    with pytest.raises(InvalidRequestError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5).verify()


def test_verify_accepts_edges() -> None:
    SamplingParams().verify(V)
    SamplingParams(
        temperature=0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        frequency_penalty=-2,
        presence_penalty=2,
        min_new_tokens=5,
        max_new_tokens=5,
        stop_token_ids=(V - 1,),
        stop=("\n",),
        seed=-7,
    ).verify(V)
    SamplingParams(stop_token_ids=(10**6,)).verify()  # no vocab known: only the sign is checked


def test_params_roundtrip_msgspec() -> None:
    import msgspec

    p = SamplingParams(temperature=0.3, stop=("a", "b"), stop_token_ids=(3,), seed=9)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy


# -- greedy and its limits -------------------------------------------------------------------------------------------
def test_greedy_is_exactly_argmax_of_raw_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 5000) * 3
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: first index wins, as in torch/HF argmax
    ids = sample([make_req(str(i), temperature=0.0) for i in range(16)], logits)
    assert torch.equal(ids, torch.argmax(logits, dim=-1))
    assert ids[3] == 10


def test_mixed_batch_greedy_rows_unaffected_by_sampled_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, V)
    reqs = [make_req(str(i), temperature=0.0 if i % 2 else 1.0) for i in range(8)]
    ids = sample(reqs, logits)
    assert torch.equal(ids[1::2], torch.argmax(logits[1::2], dim=-1))


def test_small_temperature_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, V) * 5
    argmax = torch.argmax(logits, dim=-1)
    logits[torch.arange(64), argmax] += 0.01  # a gap of >= 0.01 / T=1e-4 makes the softmax a point mass
    for params in ({"temperature": 1e-4}, {"top_k": 1, "temperature": 2.0}, {"top_p": 1e-6}):
        ids = sample([make_req(str(i), **params) for i in range(64)], logits)
        assert torch.equal(ids, argmax), params


# -- the sampled distribution ----------------------------------------------------------------------------------------
def test_plain_sampling_matches_softmax_with_temperature() -> None:
    for t in (1.0, 2.0):
        freq = empirical({"temperature": t}, LOG_PROBS)
        assert torch.allclose(freq, torch.softmax(LOG_PROBS / t, -1), atol=0.015), t


def test_top_k_and_top_p_truncate_then_renormalise() -> None:
    freq = empirical({"top_k": 2}, LOG_PROBS)
    assert freq[2:].sum() == 0 and torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.015)
    freq = empirical({"top_p": 0.7}, LOG_PROBS)  # mass before token 2 is 0.8 > 0.7
    assert freq[2:].sum() == 0 and torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.015)
    # top-p applies to the top-k-renormalised distribution (HF warper order): 0.625 > 0.6 leaves token 0 only.
    assert empirical({"top_k": 2, "top_p": 0.6}, LOG_PROBS, n=2000)[0] == 1.0


def test_top_k_top_p_match_hf_warpers() -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(3)
    row = torch.randn(V) * 2
    hf = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(10)(None, row[None].clone()))[0]
    allowed = torch.isfinite(hf)
    freq = empirical({"top_k": 10, "top_p": 0.8}, row)
    assert freq[~allowed].sum() == 0
    assert torch.allclose(freq, torch.softmax(hf, -1), atol=0.015)


def test_min_p_filters_tokens_below_threshold() -> None:
    freq = empirical({"min_p": 0.2}, LOG_PROBS)  # threshold 0.2 * 0.5 = 0.1 removes token 3 only
    assert freq[3] == 0 and freq[2] > 0.1
    assert torch.allclose(freq[:3], PROBS[:3] / PROBS[:3].sum(), atol=0.015)


# -- seeds -----------------------------------------------------------------------------------------------------------
def _decode_with_seed(target_pos: int, others: list[dict], sampler_seed: int, steps: int = 24) -> list[int]:
    """Generate ``steps`` tokens for a seeded request placed at ``target_pos`` among ``others``."""
    row = torch.randn(V, generator=torch.Generator().manual_seed(100))
    torch.manual_seed(sampler_seed)  # the other rows' logits differ between runs
    target = make_req("target", temperature=0.9, top_p=0.95, seed=1234)
    reqs = [make_req(f"o{i}", **p) for i, p in enumerate(others)]
    reqs.insert(target_pos, target)
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    sampler = Sampler(seed=sampler_seed)
    for _ in range(steps):
        logits = torch.randn(len(reqs), V) * 2  # the other rows change every step and every run
        logits[target_pos] = row
        ids = sampler(logits, info).next_token_ids
        for r, t in zip(reqs, ids.tolist(), strict=True):
            r.output_ids.append(t)
        info.cumulate_output_tokens(ids)
    return target.output_ids


def test_seeded_request_reproducible_across_batch_composition_and_position() -> None:
    alone = _decode_with_seed(0, [], sampler_seed=0)
    assert len(set(alone)) > 3  # it really samples
    mixed = [{}, {"seed": 7}, {"temperature": 0.0}, {"top_k": 5, "seed": 1234}, {"min_p": 0.1}]
    assert _decode_with_seed(3, mixed, sampler_seed=5) == alone
    assert _decode_with_seed(5, mixed[::-1], sampler_seed=9) == alone


def test_seeded_request_survives_rebuild_and_differs_by_seed() -> None:
    torch.manual_seed(4)
    row = torch.randn(1, V)
    a = make_req("a", seed=11)
    b = make_req("b", seed=12)
    a.output_ids = [3, 4, 5]  # e.g. a retracted request, or the decode node continuing after prefill's token
    rebuilt = [sample([a], row, Sampler(seed=s)).item() for s in range(5)]
    assert len(set(rebuilt)) == 1
    seq_a, seq_b = [], []
    for step in range(16):
        a.output_ids, b.output_ids = [1] * step, [1] * step
        seq_a.append(sample([a], row).item())
        seq_b.append(sample([b], row).item())
    assert seq_a != seq_b and len(set(seq_a)) > 1


# -- penalties -------------------------------------------------------------------------------------------------------
def test_repetition_penalty_matches_hf_processor_exactly() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(5)
    logits = torch.randn(1, V) * 3
    r = make_req(prompt=[1, 2, 3, 2], repetition_penalty=1.7)
    r.output_ids = [9, 40]
    ours = PenaltyState.from_reqs([r], V, "cpu").apply(logits)
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([r.all_ids()]), logits.clone())
    assert torch.equal(ours, hf)


def test_repetition_penalty_lowers_repeated_token_probability() -> None:
    row = torch.tensor([2.0, 1.5, -0.5, 1.0])
    base = empirical({}, row)
    pen = empirical({"repetition_penalty": 2.0}, row, prompt=[0, 2])
    expected = torch.softmax(torch.tensor([1.0, 1.5, -1.0, 1.0]), -1)  # 2/2 and -0.5*2
    assert pen[0] < base[0] - 0.1 and pen[2] < base[2]
    assert torch.allclose(pen, expected, atol=0.015)


def test_frequency_and_presence_penalties_shift_mass_from_generated_tokens() -> None:
    row = torch.zeros(4)
    r = make_req(frequency_penalty=0.5, presence_penalty=1.0)
    r.output_ids = [1, 1, 1, 2]
    shifted = PenaltyState.from_reqs([r], 4, "cpu").apply(row[None])[0]
    assert torch.equal(shifted, torch.tensor([0.0, -2.5, -1.5, 0.0]))
    prompt_only = make_req(prompt=[1, 1, 1], frequency_penalty=2.0)  # prompt tokens are not counted
    assert torch.equal(PenaltyState.from_reqs([prompt_only], 4, "cpu").apply(row[None])[0], row)
    freq = empirical({"frequency_penalty": 0.5, "presence_penalty": 1.0}, row, output=[1, 1, 1, 2])
    assert freq[1] < 0.05 and freq[2] < freq[0] - 0.2
    assert torch.allclose(freq, torch.softmax(shifted, -1), atol=0.015)


def test_min_new_tokens_masks_stop_tokens_until_reached() -> None:
    row = torch.full((1, V), -5.0)
    row[0, EOS], row[0, 9], row[0, 10] = 10.0, 8.0, 1.0
    r = make_req(temperature=0.0, min_new_tokens=2, stop_token_ids=(9,))
    info = SamplingBatchInfo.from_reqs([r], V, "cpu")
    sampler = Sampler(seed=0)
    got = []
    for _ in range(3):
        t = sampler(row, info).next_token_ids
        got.append(t.item())
        info.cumulate_output_tokens(t)
    assert got == [10, 10, EOS]
    ignore = make_req(temperature=0.0, min_new_tokens=2, ignore_eos=True)
    assert sample([ignore], row).item() == EOS  # ignore_eos: EOS is just a token, not masked


def _penalised_reqs() -> list[Req]:
    return [
        make_req("a", repetition_penalty=1.3, frequency_penalty=0.4, seed=1),
        make_req("b"),
        make_req("c", presence_penalty=0.7, min_new_tokens=5, stop_token_ids=(3,)),
        make_req("d", temperature=0.0),
    ]


def _step(reqs: list[Req], info: SamplingBatchInfo, sampler: Sampler) -> None:
    ids = sampler(torch.randn(len(reqs), V), info).next_token_ids
    for r, t in zip(reqs, ids.tolist(), strict=True):
        r.output_ids.append(t)
    info.cumulate_output_tokens(ids)


def _assert_same_state(info: SamplingBatchInfo, reqs: list[Req]) -> None:
    fresh = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    assert info.output_lens == fresh.output_lens
    assert set(info.penalties.components) == set(fresh.penalties.components)
    probe = torch.randn(len(reqs), V)
    assert torch.equal(info.penalties.apply(probe), fresh.penalties.apply(probe))
    for name in ("sampled_rows", "all_greedy", "need_top_k", "need_top_p", "need_min_p", "seeds"):
        assert getattr(info, name) == getattr(fresh, name), name
    for name in ("temperatures", "top_ps", "top_ks", "min_ps"):
        assert torch.equal(getattr(info, name), getattr(fresh, name)), name


def test_penalty_state_filter_and_merge_equal_a_rebuild() -> None:
    torch.manual_seed(6)
    sampler = Sampler(seed=0)
    reqs = _penalised_reqs()
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    for _ in range(3):
        _step(reqs, info, sampler)
    _assert_same_state(info, reqs)

    info.filter_batch([2, 0])  # drop b and d, reorder
    reqs = [reqs[2], reqs[0]]
    _assert_same_state(info, reqs)

    new = [make_req("e", prompt=[8, 8, 9]), make_req("f", repetition_penalty=0.8)]
    new[1].output_ids = [4]  # e.g. a prebuilt decode request whose first token came from prefill
    info.merge_batch(SamplingBatchInfo.from_reqs(new, V, "cpu"))
    reqs += new
    _assert_same_state(info, reqs)
    for _ in range(2):
        _step(reqs, info, sampler)
    _assert_same_state(info, reqs)


def test_filter_drops_unused_components_and_merge_into_plain_or_empty_batch() -> None:
    reqs = _penalised_reqs()
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    info.filter_batch([1, 3])
    assert not info.penalties.is_active
    plain = SamplingBatchInfo.from_reqs([make_req("x")], V, "cpu")
    plain.merge_batch(SamplingBatchInfo.from_reqs(reqs[:1], V, "cpu"))
    _assert_same_state(plain, [make_req("x"), reqs[0]])
    info.filter_batch([])
    assert len(info) == 0 and info.all_greedy
    info.merge_batch(SamplingBatchInfo.from_reqs(reqs[2:3], V, "cpu"))
    _assert_same_state(info, reqs[2:3])


# -- logprobs --------------------------------------------------------------------------------------------------------
def test_logprobs_are_of_raw_logits_for_requesting_rows() -> None:
    torch.manual_seed(7)
    logits = torch.randn(3, V)
    reqs = [
        Req(
            "a",
            [1],
            SamplingParams(temperature=0.5, repetition_penalty=1.5),
            return_logprob=True,
            top_logprobs_num=3,
        ),
        Req("b", [1], SamplingParams(temperature=0.0)),
        Req("c", [1], SamplingParams(temperature=0.0), return_logprob=True),
    ]
    out = Sampler(seed=0)(logits, SamplingBatchInfo.from_reqs(reqs, V, "cpu"))
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert torch.allclose(out.logprobs, ref.gather(1, out.next_token_ids[:, None])[:, 0])
    best = ref[0].topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == best.indices.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(best.values.tolist())
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []
    none = Sampler(seed=0)(logits, SamplingBatchInfo.from_reqs([reqs[1]] * 3, V, "cpu"))
    assert none.logprobs is None and none.top_logprobs is None


def test_param_columns_are_reused_only_for_the_same_params() -> None:
    """A decode batch keeps its requests: its params' columns come from the last build; any other batch's do not."""
    greedy = [make_req(f"g{i}", temperature=0.0) for i in range(3)]
    warm = [make_req(f"w{i}", temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=i) for i in range(3)]
    a = SamplingBatchInfo.from_reqs(greedy, 64, "cpu")
    b = SamplingBatchInfo.from_reqs(warm, 64, "cpu")
    assert a.all_greedy and not b.all_greedy and b.sampled_rows == [0, 1, 2] and b.seeds == [0, 1, 2]
    assert b.temperatures.tolist() == pytest.approx([0.7] * 3) and b.top_ks.tolist() == [5] * 3
    again = SamplingBatchInfo.from_reqs(warm, 64, "cpu")
    assert again.temperatures is b.temperatures  # the same batch: reused
    mixed = SamplingBatchInfo.from_reqs([greedy[0], warm[1]], 64, "cpu")
    assert mixed.sampled_rows == [1] and mixed.top_ks.tolist() == [5] and mixed.seeds == [1]
    assert SamplingBatchInfo.from_reqs(greedy, 64, "cpu").all_greedy
    assert not SamplingBatchInfo.from_reqs(warm, 32, "cpu").need_top_k or b.sort_width  # another vocab: rebuilt
    mixed.filter_batch([0])
    assert mixed.all_greedy and mixed.sampled_rows == []
