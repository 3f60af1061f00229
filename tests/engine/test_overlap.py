"""The overlap schedule: batch k+1 is prepared while batch k's forward runs, and nothing a client sees changes.

Exactness is checked against the normal loop on the same requests (seeded sampling, penalties, stop tokens,
logprobs, max_new_tokens 1, chunked + mixed prefill, the prefix cache); HF identity and retraction run with overlap on and off
in ``test_engine.py``. Overlap itself is measured from timestamps, not assumed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from common.node.engine import Engine, GenerateOutput
from tests.engine.test_engine import greedy, make_prompts, overlap_flags


def record_intervals(
    engine: Engine, forward_delay_s: float = 0.0
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Wrap the runner's forward (forward thread) and batch preparation (scheduler thread) to log their intervals.
    ``forward_delay_s``: each forward also sleeps this long (a core-free stand-in for a bigger model's forward)."""
    sched = engine.scheduler
    forwards: list[tuple[float, float]] = []
    preps: list[tuple[float, float]] = []
    lock = threading.Lock()

    def timed(fn: Any, out: list[tuple[float, float]]) -> Any:
        def wrapper(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                result = fn(*args)
                if out is forwards and forward_delay_s:
                    time.sleep(forward_delay_s)
                return result
            finally:
                with lock:
                    out.append((t0, time.perf_counter()))
        return wrapper

    sched.runner.launch = timed(sched.runner.launch, forwards)  # type: ignore[method-assign]
    sched.get_next_batch_to_run = timed(sched.get_next_batch_to_run, preps)  # type: ignore[method-assign]
    return forwards, preps


def preps_inside_forwards(forwards: list[tuple[float, float]], preps: list[tuple[float, float]]) -> int:
    return sum(any(f0 < p0 and p1 < f1 for f0, f1 in forwards) for p0, p1 in preps)


@pytest.mark.parametrize("overlap", [True, False])
def test_next_batch_is_prepared_while_the_forward_runs(engine_factory, model_path, overlap) -> None:
    engine = engine_factory(model_path, page_size=16, **overlap_flags(overlap))
    engine.generate(input_ids=[1, 2, 3], sampling_params=greedy(2))  # warm-up, outside the record
    # The tiny model's forward is shorter than a preparation on a loaded machine (CI: 2 of 25 inside, once in a few
    # runs): each forward also sleeps 30 ms, as a bigger model's would take, leaving the scheduler thread a core.
    forwards, preps = record_intervals(engine, forward_delay_s=0.03)
    prompts = make_prompts(1000, [40, 60, 80, 100] * 4, seed=1)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(24))
    assert all(len(o.output_ids) == 24 for o in outs)
    inside = preps_inside_forwards(forwards, preps)
    if overlap:
        # Decode step k+1 is prepared during forward k; with overlap off none can run inside one.
        assert inside >= len(preps) // 4, f"only {inside} of {len(preps)} preparations ran inside a forward"
    else:
        assert inside == 0


def sampled_requests(vocab: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """No penalties: every step of these overlaps, and seeded draws must use the pending token's step."""
    prompts = make_prompts(vocab, [5, 40, 70, 33, 120], seed=23)
    prompts[3] = prompts[1][:32] + prompts[3][:5]  # a prefix hit on the radix cache
    params: list[dict[str, Any]] = [
        {"max_new_tokens": 20, "temperature": 0.8, "top_p": 0.9, "seed": 5, "ignore_eos": True},
        {"max_new_tokens": 16, "temperature": 1.0, "top_k": 20, "seed": 7, "ignore_eos": True},
        {"max_new_tokens": 15, "temperature": 1.2, "min_p": 0.05, "seed": 11, "ignore_eos": True},
        greedy(1),
        greedy(30),
    ]
    return prompts, params


def penalised_requests(vocab: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Penalties read every output token: a batch with these must not run ahead of its results."""
    prompts = make_prompts(vocab, [64, 9, 200, 50], seed=29)
    params: list[dict[str, Any]] = [
        {**greedy(24), "presence_penalty": -2.0},  # a bonus on seen tokens: the last one matters at once
        {**greedy(24), "repetition_penalty": 0.5},
        {"max_new_tokens": 18, "temperature": 0.7, "frequency_penalty": -1.5, "seed": 9, "ignore_eos": True},
        {"max_new_tokens": 12, "temperature": 0.0, "min_new_tokens": 6},
    ]
    return prompts, params


def run_together(engine: Engine, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[GenerateOutput]:
    """All requests at once (one batch where they fit), each with its own sampling parameters."""

    async def one(ids: list[int], sp: dict[str, Any]) -> GenerateOutput:
        async for chunk in engine.generate_stream(input_ids=ids, sampling_params=sp, return_logprob=True):
            if chunk.output is not None:
                return chunk.output
        raise AssertionError("the stream ended without a final chunk")

    async def run() -> list[GenerateOutput]:
        return await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in zip(prompts, params, strict=True))),
                                      timeout=120)

    return asyncio.run(run())


@pytest.mark.parametrize(("chunk", "mixed"), [(-1, False), (32, True)])
def test_overlap_outputs_equal_the_normal_loop(engine_factory, model_path, chunk, mixed) -> None:
    results = []
    for overlap in (True, False):
        engine = engine_factory(model_path, page_size=16, chunked_prefill_size=chunk, enable_mixed_chunk=mixed,
                                **overlap_flags(overlap))
        vocab = engine.model_config.vocab_size
        runs = [run_together(engine, *make(vocab)) for make in (sampled_requests, penalised_requests)]
        # a stop token taken from an unconstrained run of the same prompt ends its request early
        prompt = make_prompts(vocab, [77], seed=31)[0]
        free = engine.generate(input_ids=prompt, sampling_params=greedy(12))
        stop = engine.generate(input_ids=prompt, sampling_params={**greedy(12), "stop_token_ids": [free.output_ids[5]]})
        results.append(([o for outs in runs for o in outs], stop.output_ids))
    (ours, stop_ids), (normal, normal_stop_ids) = results
    for i, (a, b) in enumerate(zip(ours, normal, strict=True)):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason), f"request {i}"
        # batch shapes differ between the loops (a finished request runs one extra step with overlap): fp32 noise
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4), f"request {i}"
    assert stop_ids == normal_stop_ids and len(stop_ids) <= 6
    assert [len(o.output_ids) for o in ours] == [20, 16, 15, 1, 30, 24, 24, 18, len(ours[8].output_ids)]
    assert 6 <= len(ours[8].output_ids) <= 12


_EAGLE = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/head"}


@pytest.mark.parametrize(("cores", "flags", "device", "on"), [
    (2, {}, "cpu", False),  # the default threads (cores // ranks) fill the cores
    (2, {"torch_num_threads": 1}, "cpu", True),
    (8, {"torch_num_threads": 4, "dp_size": 2}, "cpu", False),
    (8, {"torch_num_threads": 3, "dp_size": 2}, "cpu", True),
    (2, {"enable_overlap_schedule": True}, "cpu", True),
    (2, {"torch_num_threads": 1, "disable_overlap_schedule": True}, "cpu", False),
    (2, {}, "cuda", True),
    (2, {"disable_overlap_schedule": True}, "cuda", False),
    # speculation: a prefill node verifies nothing and keeps it; colocated and decode nodes run without it
    (2, {**_EAGLE, "disaggregation_mode": "prefill"}, "cuda", True),
    (2, {**_EAGLE, "disaggregation_mode": "prefill", "enable_overlap_schedule": True}, "cpu", True),
    (2, {**_EAGLE, "disaggregation_mode": "decode"}, "cuda", False),
    (2, {**_EAGLE, "speculative_algorithm": "STANDALONE"}, "cuda", False),
])
def test_overlap_default_leaves_the_cpu_forward_its_cores(monkeypatch, cores, flags, device, on) -> None:
    import common.engine.device
    import common.engine.overlap
    from common.config import ServerArgs

    monkeypatch.setattr(common.engine.device, "usable_cores", lambda: cores)
    monkeypatch.setattr(common.engine.overlap, "usable_cores", lambda: cores)
    assert common.engine.overlap.overlap_schedule_on(ServerArgs(**flags), torch.device(device)) is on


def test_contradicting_overlap_flags_rejected() -> None:
    from common.config import ServerArgs
    from common.errors import ConfigError

    with pytest.raises(ConfigError, match="contradict"):
        ServerArgs(enable_overlap_schedule=True, disable_overlap_schedule=True)
