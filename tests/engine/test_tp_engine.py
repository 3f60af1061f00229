"""A tp 2 scheduler produces exactly the greedy tokens of Hugging Face transformers (and so of tp 1) over the
engine's prompt matrix: page size 1 and 16, chunked prefill on/off, radix cache on/off, mixed chunks on/off.

The matrix runs in ONE pair of spawned gloo ranks (a scheduler per configuration, fed the same inputs on both
ranks, as the leader's broadcast would); ``Engine(tp_size=2)`` runs end to end with its follower process for the
broadcast path. Every rank's pools are checked back at their free counts after each configuration.

The same pair then runs the hierarchical cache: rank 1's loads are slower than rank 0's, its first one past
--hicache-load-timeout, yet both settle every load at the same step (``LoadWaits.poll``: done, failed or expired,
agreed over the group), so they admit the same requests, count the same host hits and produce the same tokens.
With ``write_back``, rank 1's eviction writes fail or hang: the ranks agree to drop those host copies
(``LoadWaits.settle_write``), so they again hit and miss the host alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from common.engine.distributed import TPGroup
from tests.engine.test_engine import LENGTHS, MATRIX, greedy, hf_greedy, make_prompts, overlap_flags
from tests.engine.test_hicache import BASE, FULL, PROMPTS
from tests.model_fixtures import make_tiny_model
from tests.tp_helpers import run_ranks

pytestmark = pytest.mark.slow  # spawns rank processes
NEW_TOKENS = 12
SLOW_FIRST_S, SLOW_S = 1.5, 0.2  # rank 1's first load, its later ones (--hicache-load-timeout 0.5)
WRITE_WAIT_S, HANG_S = 0.3, 1.0  # how long a step waits for its eviction write; rank 1's hung write


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


def _hicache_passes(tp: TPGroup, model: str, runs: str, fault: Callable[[Any], None], given_up_pages: str,
                    write_timeout_s: float | None = None, **hicache: Any) -> dict[str, Any]:
    """The hierarchical cache's prompts once per letter of ``runs`` (the later passes hit what the earlier ones left
    on the host), ``fault(job)`` before each of this rank's copies; what each request got and cached, the host hits
    and the pages of each job given up on (its ``given_up_pages``)."""
    import msgspec

    from common.config import ServerArgs
    from common.engine.io_struct import GenerateReqInput, TokenOut
    from common.engine.mem.hicache.copy_engine import CopyEngine
    from common.engine.mem.hicache.load_waits import LoadWaits
    from common.engine.sampling.params import SamplingParams
    from common.engine.scheduler import Scheduler
    from common.text.tokenizer import load_tokenizer

    copy, abandon = CopyEngine._copy_pages, LoadWaits.abandon
    given_up: list[int] = []

    def faulty(self: CopyEngine, job: Any) -> Any:
        fault(job)
        return copy(self, job)

    def counted(self: LoadWaits, job: Any, release: Any) -> None:
        given_up.append(len(getattr(job, given_up_pages)))
        abandon(self, job, release)

    CopyEngine._copy_pages, LoadWaits.abandon = faulty, counted  # type: ignore[method-assign]
    args = ServerArgs(model_path=model, tp_size=2, **BASE, enable_hierarchical_cache=True, hicache_ratio=4.0,
                      **hicache)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, tuple[int, int]] = {}

    def collect(msgs: list[Any]) -> None:
        for m in msgs:
            if isinstance(m, TokenOut):
                tokens.setdefault(m.rid, []).extend(m.token_ids)
                if m.finish_reason:
                    cached[m.rid] = (m.cached_tokens, m.timing.cached_tokens_host if m.timing else -1)

    sched = Scheduler(args, model, load_tokenizer(model), collect, 0, tp)
    cache = sched.tree_cache
    if write_timeout_s is not None:
        cache.waits.write_timeout_s = write_timeout_s
    sp = msgspec.convert(greedy(6), SamplingParams)
    for run in runs:
        sched.step([GenerateReqInput(rid=f"{run}{i}", input_ids=p, sampling_params=sp) for i, p in enumerate(PROMPTS)])
        deadline = time.monotonic() + 120
        while (not sched.is_idle() or cache.waits.settling or cache.writing) and time.monotonic() < deadline:  # agreed
            sched.step([])
    sched.close()
    CopyEngine._copy_pages, LoadWaits.abandon = copy, abandon  # type: ignore[method-assign]
    host_held = sum(len(n.host_pages) for n in cache._nodes() if n.host_pages is not None)
    leak = _pools_released(sched) or (None if cache.host_pool.used_pages == host_held else "host pages leaked")
    return {"tokens": tokens, "cached": cached, "given_up": given_up, "leak": leak,
            "host_hits": dict(cache.stats.hit_tokens)}


def _hicache_rank(tp: TPGroup, model: str) -> dict[str, Any]:
    """Three passes (b: rank 1's first load expires, its pages free at once; c: none does), rank 1's loads
    delayed; the loads given up on."""
    delays = [SLOW_FIRST_S] if tp.tp_rank == 1 else []

    def delayed(job: Any) -> None:
        if job.kind == "load" and tp.tp_rank == 1:
            time.sleep(delays.pop() if delays else SLOW_S)

    return _hicache_passes(tp, model, "abc", delayed, "device_pages", hicache_load_timeout=0.5)


def _write_back_rank(tp: TPGroup, model: str) -> dict[str, Any]:
    """``write_back``: two passes (the second loads what the first's evictions wrote back), rank 1's first eviction
    write failing and its second hanging past the step's wait; the writes given up on."""
    faults = ["fail", "hang"] if tp.tp_rank == 1 else []

    def faulty(job: Any) -> None:
        fault = faults.pop(0) if job.kind == "write" and faults else None
        if fault == "fail":
            raise RuntimeError("injected: rank 1's eviction write fails")
        if fault == "hang":  # past the step's wait: it is cancelled before it writes the host pages
            time.sleep(HANG_S)

    return _hicache_passes(tp, model, "ab", faulty, "host_pages", write_timeout_s=WRITE_WAIT_S,
                           hicache_write_policy="write_back")


def _ranks(tp: TPGroup, model: str) -> dict[str, Any]:
    return {"matrix": _matrix_rank(tp, model), "hicache": _hicache_rank(tp, model),
            "write_back": _write_back_rank(tp, model)}


@pytest.fixture(scope="module")
def tp2_ranks() -> list[dict[str, Any]]:
    """One spawned pair of ranks for the matrix and the hierarchical cache (a pair's start-up is most of its cost)."""
    return run_ranks(_ranks, 2, str(make_tiny_model("llama")), deadline_s=400)


def test_tp2_matrix_matches_hf(tp2_ranks) -> None:
    model = str(make_tiny_model("llama"))
    by_rank = [r["matrix"] for r in tp2_ranks]
    for cfg, r0, r1 in zip(TP_MATRIX, by_rank[0], by_rank[1], strict=True):
        page_size, chunk, *_ = cfg
        assert r0["outputs"] == r1["outputs"], f"ranks disagree at {cfg}"
        assert r0["leak"] is None and r1["leak"] is None, (cfg, r0["leak"], r1["leak"])
        prompts = make_prompts(1000, LENGTHS, seed=page_size + chunk)
        for prompt, got in zip(prompts, r0["outputs"], strict=True):
            assert got == hf_greedy(model, tuple(prompt), NEW_TOKENS), f"{cfg}: prompt len {len(prompt)}"


def test_tp2_hicache_ranks_agree_on_every_load(tp2_ranks) -> None:
    r0, r1 = (r["hicache"] for r in tp2_ranks)
    assert r0["leak"] is None and r1["leak"] is None, (r0["leak"], r1["leak"])
    assert r0["tokens"] == r1["tokens"] and r0["cached"] == r1["cached"]  # the same admissions on both ranks
    assert all(r0["tokens"][f"{run}{i}"] == r0["tokens"][f"a{i}"] for i in range(len(PROMPTS)) for run in "bc")
    assert r0["given_up"] == r1["given_up"] and r0["given_up"]  # rank 1's first load (and those behind it)
    assert any(r0["cached"][f"c{i}"] == (FULL, FULL) for i in range(len(PROMPTS)))  # its later loads came back


def test_tp2_ranks_agree_when_one_ranks_eviction_write_fails(tp2_ranks) -> None:
    """Rank 1's first write-back fails and its second hangs: both ranks drop those host copies (the prefixes are
    recomputed, the same tokens) and keep the others, so they hit and miss the host alike."""
    r0, r1 = (r["write_back"] for r in tp2_ranks)
    assert r0["leak"] is None and r1["leak"] is None, (r0["leak"], r1["leak"])
    assert r0["given_up"] == r1["given_up"] and len(r0["given_up"]) == 2  # the failed write and the hung one
    assert r0["tokens"] == r1["tokens"] and r0["cached"] == r1["cached"] and r0["host_hits"] == r1["host_hits"]
    fresh = tp2_ranks[0]["hicache"]["tokens"]  # the other run's first pass: nothing cached yet
    assert all(r0["tokens"][f"{run}{i}"] == fresh[f"a{i}"] for i in range(len(PROMPTS)) for run in "ab")
    host = [r0["cached"][f"b{i}"][1] for i in range(len(PROMPTS))]
    assert FULL in host and min(host) < FULL, host  # the copies kept serve; the dropped ones are recomputed


def test_engine_tp2_serves_and_releases(engine_factory) -> None:
    model = make_tiny_model("llama")
    engine = engine_factory(model, tp_size=2, page_size=16, chunked_prefill_size=32, torch_num_threads=1)
    prompts = make_prompts(1000, [5, 40, 100], seed=3)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_ids == hf_greedy(str(model), tuple(prompt), NEW_TOKENS)
    load = engine.get_load()
    assert load.free_req_slots == load.total_req_slots  # MIN over both ranks
