"""The scheduler's mechanisms, each observed doing its job in one in-process ``Scheduler`` (no threads, no overlap):
mixed chunks advance decode requests inside a prefill chunk's forward, and ``new_token_ratio`` decays per decode step,
jumps on retraction, and is what prefill admission reserves for the running requests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from common.config import ServerArgs
from common.engine.forward_batch import ForwardMode
from common.engine.io_struct import GenerateReqInput
from common.engine.sampling.params import SamplingParams
from common.engine.scheduler import Scheduler
from common.text.tokenizer import load_tokenizer
from tests.model_fixtures import make_tiny_model

MAX_STEPS = 2000  # every loop below is bounded by it


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 900 + 10 for j in range(n)]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(str(make_tiny_model("llama")))


@pytest.fixture
def make_scheduler(tokenizer) -> Iterator[Any]:
    """An in-process scheduler (overlap off: one step = one forward); its pools are back at their free counts after
    the test."""
    made: list[Scheduler] = []

    def make(**overrides: Any) -> Scheduler:
        model = str(make_tiny_model("llama"))
        args = ServerArgs(model_path=model, **{"max_total_tokens": 4096, "max_running_requests": 16,
                                               "disable_overlap_schedule": True, **overrides})
        sched = Scheduler(args, model, tokenizer, lambda msgs: None)
        made.append(sched)
        return sched

    yield make
    for sched in made:
        try:
            for _ in range(MAX_STEPS):
                if sched.is_idle():
                    break
                sched.step([])
            assert sched.is_idle()
            assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
            sched.tree_cache.evict(sched.allocator.size)
            assert sched.allocator.available_size() == sched.allocator.size
        finally:
            sched.close()


def test_mixed_chunk_advances_decodes_in_the_prefill_chunks_forward(make_scheduler) -> None:
    sched = make_scheduler(page_size=4, chunked_prefill_size=16, enable_mixed_chunk=True)
    sched.step([GenerateReqInput(rid="dec", input_ids=prompt(8, 1), sampling_params=greedy(30))])
    sched.step([])
    dec = sched.intake.reqs_by_rid["dec"]
    assert sched.decode.last_batch is not None and sched.decode.last_batch.forward_mode == ForwardMode.DECODE
    sched.step([GenerateReqInput(rid="long", input_ids=prompt(60, 2), sampling_params=greedy(4))])
    long = sched.intake.reqs_by_rid["long"]
    mixed_steps = 0
    for _ in range(4):  # 60 prompt tokens in chunks of 16 (minus the mixed decode's token): four chunks
        before_out, before_kv = len(dec.output_ids), long.kv_committed_len
        sched.step([])
        batch = sched.decode.last_batch
        assert batch is not None
        if long.kv_committed_len > before_kv:  # a chunk of the long prompt ran in this step
            assert batch.forward_mode == ForwardMode.MIXED, (
                f"the prefill chunk ran as {batch.forward_mode.name}, not mixed with the running decode request"
            )
            assert len(dec.output_ids) == before_out + 1, "the decode request did not advance in the chunk's step"
            mixed_steps += 1
    assert mixed_steps >= 2, f"only {mixed_steps} prefill chunks ran mixed with decoding"


def test_new_token_ratio_decays_per_decode_step_to_its_floor(make_scheduler) -> None:
    sched = make_scheduler(page_size=1)
    init, decay, floor = sched.prefill.init_new_token_ratio, sched.prefill.new_token_ratio_decay, sched.prefill.min_new_token_ratio
    assert init > floor > 0 and decay > 0
    sched.step([GenerateReqInput(rid="a", input_ids=prompt(10, 3), sampling_params=greedy(40))])
    assert sched.prefill.new_token_ratio == init  # a prefill step does not decay it
    for n in range(1, 30):
        sched.step([])
        assert sched.decode.last_batch is not None and sched.decode.last_batch.forward_mode == ForwardMode.DECODE
        assert sched.prefill.new_token_ratio == pytest.approx(init - n * decay), f"after {n} decode steps"
    sched.prefill.new_token_ratio = floor + decay / 2
    sched.step([])
    assert sched.prefill.new_token_ratio == floor  # never below the floor


def test_new_token_ratio_jumps_on_retraction(make_scheduler) -> None:
    sched = make_scheduler(page_size=1, max_total_tokens=400)
    sched.step([GenerateReqInput(rid=f"r{i}", input_ids=prompt(n, i), sampling_params=greedy(48))
                for i, n in enumerate([30, 45, 20, 60, 35, 50, 25, 40])])
    jumps = []
    for _ in range(MAX_STEPS):
        if sched.is_idle():
            break
        before_ratio, before_retracted = sched.prefill.new_token_ratio, sched.decode.num_retracted
        sched.step([])
        if sched.decode.num_retracted > before_retracted:
            jumps.append((before_ratio, sched.prefill.new_token_ratio))
        elif sched.decode.last_batch is not None and sched.decode.last_batch.forward_mode == ForwardMode.DECODE:
            assert sched.prefill.new_token_ratio <= before_ratio  # only a retraction raises it
    assert jumps, "the KV budget was meant to force a retraction"
    for before, after in jumps:
        assert after > before + 10 * sched.prefill.new_token_ratio_decay, f"retraction moved the ratio {before} -> {after}"


@pytest.mark.parametrize(("ratio", "admitted"), [(0.9, False), (0.2, True)])
def test_prefill_admission_reserves_new_token_ratio_of_running_requests(make_scheduler, ratio, admitted) -> None:
    """A waiting request that fits beside the running one's ``ratio * remaining max_new_tokens`` reservation is
    admitted at a low ratio and held at a high one."""
    sched = make_scheduler(page_size=1, max_total_tokens=1000, max_prefill_tokens=1000, chunked_prefill_size=-1)
    sched.step([GenerateReqInput(rid="run", input_ids=prompt(10, 4), sampling_params=greedy(800))])
    sched.step([])
    assert sched.decode.last_batch is not None and sched.decode.last_batch.forward_mode == ForwardMode.DECODE
    run = sched.intake.reqs_by_rid["run"]
    free = sched.allocator.available_size() + sched.tree_cache.evictable_size()
    need = 300 + 20  # the waiting request's prompt + max_new_tokens

    def fits(r: float) -> bool:  # the next step decodes one more token of "run" before admission
        return need < free - 1 - (int((800 - len(run.output_ids) - 1) * r) + 1)

    assert fits(ratio) == admitted
    sched.prefill.new_token_ratio = ratio
    sched.step([GenerateReqInput(rid="wait", input_ids=prompt(300, 5), sampling_params=greedy(20))])
    assert sched.decode.last_batch is not None
    if admitted:
        assert sched.prefill.waiting_queue == [], f"held at ratio {ratio} although its reservation leaves room"
        assert sched.decode.last_batch.forward_mode == ForwardMode.EXTEND
    else:
        assert [r.rid for r in sched.prefill.waiting_queue] == ["wait"], f"admitted at ratio {ratio} beyond the reservation"
        assert sched.decode.last_batch.forward_mode == ForwardMode.DECODE
    sched.abort_request("run", "test done")
