"""A tp 2 scheduler produces exactly the greedy tokens of Hugging Face transformers (and so of tp 1) over the
engine's prompt matrix: page size 1 and 16, chunked prefill on/off, radix cache on/off, mixed chunks on/off.

The matrix runs in ONE pair of spawned gloo ranks (a scheduler per configuration, fed the same inputs on both
ranks, as the leader's broadcast would); ``Engine(tp_size=2)`` runs end to end with its follower process for the
broadcast path. Every rank's pools are checked back at their free counts after each configuration.
"""

from __future__ import annotations

from typing import Any

import pytest

from common.engine.distributed import TPGroup
from tests.engine.test_engine import LENGTHS, MATRIX, greedy, hf_greedy, make_prompts, overlap_flags
from tests.model_fixtures import make_tiny_model
from tests.tp_helpers import run_ranks

pytestmark = pytest.mark.slow  # spawns rank processes
NEW_TOKENS = 12


def _pools_released(sched: Any) -> str | None:
    s = sched
    if s.req_to_token_pool.available_size() != s.req_to_token_pool.size:
        return "request slots leaked"
    if s.tree_cache.protected_size():
        return "prefix cache holds locked nodes"
    s.tree_cache.evict(s.allocator.size)
    if s.allocator.available_size() != s.allocator.size:
        return f"KV slots leaked: {s.allocator.size - s.allocator.available_size()}"
    return None


# The engine's matrix once per setting, the overlap schedule on for every other one.
TP_MATRIX = [(*cfg[:4], i % 2 == 0) for i, cfg in enumerate(MATRIX[::2])]


def _matrix_rank(tp: TPGroup, model: str) -> list[dict[str, Any]]:
    import msgspec

    from common.config import ServerArgs
    from common.engine.io_struct import GenerateReqInput, TokenOut
    from common.engine.sampling.params import SamplingParams
    from common.engine.scheduler import Scheduler
    from common.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    results = []
    for page_size, chunk, disable_radix, mixed, overlap in TP_MATRIX:
        args = ServerArgs(model_path=model, tp_size=2, page_size=page_size, chunked_prefill_size=chunk,
                          disable_radix_cache=disable_radix, enable_mixed_chunk=mixed, max_total_tokens=4096,
                          max_running_requests=64, **overlap_flags(overlap))
        outputs: dict[str, list[int]] = {}

        def collect(msgs: list[Any], outputs: dict[str, list[int]] = outputs) -> None:
            for m in msgs:
                if isinstance(m, TokenOut):
                    outputs.setdefault(m.rid, []).extend(m.token_ids)

        sched = Scheduler(args, model, tokenizer, collect, 0, tp)
        prompts = make_prompts(1000, LENGTHS, seed=page_size + chunk)
        sp = msgspec.convert(greedy(NEW_TOKENS), SamplingParams)
        msgs = [GenerateReqInput(rid=f"r{i}", input_ids=p, sampling_params=sp) for i, p in enumerate(prompts)]
        steps = 0
        sched.step(msgs)
        while not sched.is_idle() and steps < 2000:
            sched.step([])
            steps += 1
        load = sched.get_load()  # a collective: MIN over the ranks; divergence is logged
        sched.close()
        results.append({"outputs": [outputs.get(f"r{i}", []) for i in range(len(prompts))],
                        "leak": _pools_released(sched), "free_req_slots": load.free_req_slots})
    return results


def test_tp2_matrix_matches_hf() -> None:
    model = str(make_tiny_model("llama"))
    by_rank = run_ranks(_matrix_rank, 2, model, deadline_s=400)
    for cfg, r0, r1 in zip(TP_MATRIX, by_rank[0], by_rank[1], strict=True):
        page_size, chunk, *_ = cfg
        assert r0["outputs"] == r1["outputs"], f"ranks disagree at {cfg}"
        assert r0["leak"] is None and r1["leak"] is None, (cfg, r0["leak"], r1["leak"])
        prompts = make_prompts(1000, LENGTHS, seed=page_size + chunk)
        for prompt, got in zip(prompts, r0["outputs"], strict=True):
            assert got == hf_greedy(model, tuple(prompt), NEW_TOKENS), f"{cfg}: prompt len {len(prompt)}"


def test_engine_tp2_serves_and_releases(engine_factory) -> None:
    model = make_tiny_model("llama")
    engine = engine_factory(model, tp_size=2, page_size=16, chunked_prefill_size=32, torch_num_threads=1)
    prompts = make_prompts(1000, [5, 40, 100], seed=3)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_ids == hf_greedy(str(model), tuple(prompt), NEW_TOKENS)
    load = engine.get_load()
    assert load.free_req_slots == load.total_req_slots  # MIN over both ranks
