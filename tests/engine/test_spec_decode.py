"""Speculative decoding in one in-process ``Scheduler`` (no threads): with NGRAM or STANDALONE drafts the output is
token for token the output without speculation — greedy, and seeded sampling with penalties (verification draws
each position with the plain decode's uniform) — through page sizes 1 and 16, chunked prefill, radix hits and
``n > 1`` prompts, retraction, a grammar, stop strings and stop tokens inside an accepted run, and a migrated
request; drafts were both accepted and rejected, and the KV pools (the draft model's too) come back whole.

The copy model (``make_copy_model``: attention writes nothing, so greedy decoding cycles) gives NGRAM long accepted
runs; the tiny model's own outputs do not repeat, so most of its drafts are rejected."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput, TokenOut
from common.engine.sampling.params import SamplingParams
from common.engine.scheduler import Scheduler
from common.text.tokenizer import load_tokenizer
from tests.conftest import assert_scheduler_pools_released
from tests.model_fixtures import make_copy_model, make_tiny_model

NEW = 48


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + 17 * j * j + 7 * j) % 1400 + 20 for j in range(n)]


def greedy(n: int = NEW, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


class Run:
    """What one scheduler produced: each request's merged output and its final message."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}
        self.final: dict[str, TokenOut] = {}

    def sink(self, msgs: list[Any]) -> None:
        for m in msgs:
            if isinstance(m, TokenOut):
                self.ids.setdefault(m.rid, []).extend(m.token_ids)
                if m.finish_reason is not None:
                    self.final[m.rid] = m


def run(model: str, reqs: list[GenerateReqInput], spec: dict[str, Any] | None = None, steps_between: int = 0,
        together: bool = False, **overrides: Any) -> tuple[Run, Scheduler]:
    """Serve ``reqs`` to the end (all in one step, or one a step with ``steps_between`` steps between) on a scheduler
    with ``spec`` flags; its pools and the draft model's are back at their free counts after."""
    args = ServerArgs(model_path=model, **{"max_total_tokens": 4096, "max_running_requests": 16,
                                           "disable_overlap_schedule": True, **(spec or {}), **overrides})
    out = Run()
    sched = Scheduler(args, model, load_tokenizer(model), out.sink)
    try:
        deadline = time.monotonic() + 120
        for batch in [reqs] if together else [[r] for r in reqs]:
            sched.step(batch)
            for _ in range(steps_between):
                sched.step([])
        while not sched.is_idle():
            assert time.monotonic() < deadline, "the scheduler did not finish in 120 s"
            sched.step([])
        assert_scheduler_pools_released(sched)
        drafter = sched.decode.speculator.drafter if sched.decode.speculator is not None else None
        if hasattr(drafter, "allocator"):  # STANDALONE: its own pool, freed with each request
            assert drafter.allocator.available_size() == drafter.allocator.size
    finally:
        sched.close()
    return out, sched


def gen(rid: str, ids: list[int], params: SamplingParams, **kw: Any) -> GenerateReqInput:
    return GenerateReqInput(rid=rid, input_ids=ids, sampling_params=params, **kw)


@pytest.fixture(scope="module")
def copy_model() -> str:
    return str(make_copy_model())


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def copy_reqs(copy_model) -> list[GenerateReqInput]:
    """A fresh prompt; one that already holds the model's cycle; one that holds it with every 5th token changed (its
    early drafts copy the changes: rejected) and its n > 1 twin (a radix hit); a long one (chunked)."""
    first, _ = run(copy_model, [gen("seed", prompt(20, 1), greedy(60))])
    cycle = first.ids["seed"][:50]
    cyclic = prompt(9, 2) + cycle
    noisy = prompt(9, 2) + [t + 1 if j % 5 == 2 else t for j, t in enumerate(cycle)]
    return [gen("fresh", prompt(30, 3), greedy()), gen("cyclic", cyclic, greedy()), gen("noisy", noisy, greedy()),
            gen("twin", noisy, greedy()), gen("long", prompt(150, 4), greedy(24))]


NGRAM = {"speculative_algorithm": "NGRAM"}


@pytest.mark.parametrize("page_size", [1, 16])
def test_ngram_greedy_output_is_the_plain_output(copy_model, copy_reqs, page_size, caplog) -> None:
    plain, _ = run(copy_model, copy_reqs, page_size=page_size, chunked_prefill_size=32)
    with caplog.at_level(logging.INFO, logger="common.engine.scheduler"):
        spec, _ = run(copy_model, copy_reqs, NGRAM, page_size=page_size, chunked_prefill_size=32,
                      decode_log_interval=4)
    assert spec.ids == plain.ids
    finals = spec.final.values()
    drafted = sum(f.spec_draft_tokens for f in finals)
    accepted = sum(f.spec_accepted_tokens for f in finals)
    assert 0 < accepted < drafted, (accepted, drafted)  # runs were accepted, and drafts rejected
    assert all(f.completion_tokens == len(spec.ids[f.rid]) for f in finals)  # usage counts emitted tokens only
    assert spec.final["cyclic"].spec_verify_ct < NEW // 3  # most of its tokens came in long accepted runs
    assert any("accept len: " in r.getMessage() for r in caplog.records)


def test_retracted_requests_recompute_and_keep_their_output(copy_model, copy_reqs) -> None:
    reqs = [gen(f"r{i}", prompt(20 + 8 * i, 10 + i), greedy(NEW)) for i in range(6)] + copy_reqs[1:3]
    # Admission that reserves little for running requests' future tokens over-commits the pool: retraction follows.
    small = {"max_total_tokens": 400, "page_size": 16, "together": True, "schedule_conservativeness": 0.05}
    plain, _ = run(copy_model, reqs, **small)
    spec, sched = run(copy_model, reqs, NGRAM, **small)
    assert sched.decode.num_retracted > 0, "the KV budget was meant to force a retraction"
    assert spec.ids == plain.ids


def test_tiny_models_drafts_are_mostly_rejected_and_change_nothing(tiny) -> None:
    reqs = [gen(f"t{i}", prompt(60, 20 + i) * 2, greedy(32)) for i in range(3)]  # prompts repeat: drafts are proposed
    plain, _ = run(tiny, reqs)
    spec, _ = run(tiny, reqs, {**NGRAM, "speculative_ngram_min_match_window_size": 1}, page_size=1)
    assert spec.ids == plain.ids
    assert sum(f.spec_draft_tokens for f in spec.final.values()) > 0


def test_seeded_sampling_with_penalties_draws_the_plain_tokens(copy_model, copy_reqs) -> None:
    params = SamplingParams(max_new_tokens=NEW, temperature=0.3, top_p=0.95, top_k=50, min_p=0.01, seed=99,
                            repetition_penalty=1.05, frequency_penalty=0.1, presence_penalty=0.1, min_new_tokens=8,
                            logit_bias={600: 0.5})
    # Its tokens repeat within a draft: each position's frequency penalty must count the drafts before it.
    counted = SamplingParams(max_new_tokens=40, temperature=0.3, top_p=0.95, seed=99, frequency_penalty=0.6,
                             presence_penalty=0.1, regex="(the |cat |dog |a |on ){10,30}")
    reqs = [gen(r.rid, r.input_ids, params, return_logprob=True) for r in copy_reqs[:3]]
    reqs.append(gen("counted", copy_reqs[0].input_ids, counted))
    plain, _ = run(copy_model, reqs)
    spec, _ = run(copy_model, reqs, NGRAM)
    assert spec.ids == plain.ids
    assert spec.final["cyclic"].spec_accepted_tokens > 0 and spec.final["counted"].spec_accepted_tokens > 0
    # A migrated request (its first 10 outputs in its prompt) continues the same way with speculation.
    k = 10
    cont = gen("cont", reqs[1].input_ids + plain.ids["cyclic"][:k],
               SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__}, "max_new_tokens": NEW - k,
                                 "min_new_tokens": 0}), prior_output_len=k)
    migrated, _ = run(copy_model, [cont], NGRAM)
    assert migrated.ids["cont"] == plain.ids["cyclic"][k:]


def test_stops_inside_an_accepted_run_end_the_request_there(copy_model, copy_reqs) -> None:
    base = copy_reqs[1]
    plain, _ = run(copy_model, [base])
    out = plain.ids["cyclic"]
    stop_token = out[30]  # the cycle repeats it: its first occurrence ends the request
    first = out.index(stop_token)
    tokenizer = load_tokenizer(copy_model)
    text = tokenizer.decode(out[first + 2 : first + 4])
    reqs = [gen("tok", base.input_ids, greedy(stop_token_ids=(stop_token,))),
            gen("str", base.input_ids, greedy(stop=(text,))),
            gen("len", base.input_ids, greedy(first + 3))]
    want, _ = run(copy_model, reqs)
    got, _ = run(copy_model, reqs, NGRAM)
    assert got.ids == want.ids
    assert got.ids["tok"] == out[: first + 1] and got.final["tok"].matched_stop == stop_token
    assert got.final["str"].matched_stop == text and len(got.ids["len"]) == first + 3
    assert all(got.final[r].spec_accepted_tokens > 0 for r in ("tok", "str", "len"))


def test_a_grammar_masks_every_draft_position(copy_model, copy_reqs) -> None:
    regex = "(the |cat |dog |a |on ){10,30}"  # its greedy output cycles: long runs are drafted and accepted
    reqs = [gen("g", copy_reqs[0].input_ids, greedy(40, regex=regex)), gen("free", copy_reqs[1].input_ids, greedy())]
    plain, _ = run(copy_model, reqs)
    spec, _ = run(copy_model, reqs, NGRAM)
    assert spec.ids == plain.ids
    assert spec.final["g"].spec_accepted_tokens > 10


@pytest.mark.parametrize("page_size", [1, 16])
def test_standalone_draft_model_output_is_the_plain_output(copy_model, tiny, copy_reqs, page_size) -> None:
    draft = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": copy_model,
             "speculative_num_steps": 3}
    reqs = [*copy_reqs[:3], copy_reqs[4]]
    plain, _ = run(tiny, reqs, page_size=page_size)
    spec, _ = run(tiny, reqs, draft, page_size=page_size, chunked_prefill_size=32)
    assert spec.ids == plain.ids
    assert sum(f.spec_draft_tokens for f in spec.final.values()) > 0


def test_a_standalone_draft_that_is_the_target_accepts_every_draft(tiny) -> None:
    steps = 3
    draft = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": tiny,
             "speculative_num_steps": steps}
    reqs = [gen(f"s{i}", prompt(25 + 40 * i, 30 + i), greedy(1 + 6 * (steps + 1))) for i in range(3)]
    plain, _ = run(tiny, reqs)
    spec, _ = run(tiny, reqs, draft, steps_between=2)
    assert spec.ids == plain.ids
    for f in spec.final.values():
        assert f.spec_accepted_tokens == f.spec_draft_tokens == 6 * steps
        assert (f.spec_accepted_tokens + f.spec_verify_ct) / f.spec_verify_ct == steps + 1  # accept length
