"""The load generator's statistics on synthetic traces: percentiles, ITL from token timestamps, TPOT, goodput."""

from __future__ import annotations

import math

import pytest

from benchmarks.loadgen.stats import RequestResult, Slo, describe, percentile, spread_chunk, summarize
from benchmarks.loadgen.workload import WorkloadConfig, make_workload


def req(i: int, ttft: float, gaps: list[float], ok: bool = True, error: str | None = None) -> RequestResult:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(i, "short", 0.0, ok=ok, error=error, ttft=ttft, e2e=times[-1], token_times=times,
                         prompt_tokens=10, output_tokens=len(times))


def test_percentile_interpolates_like_numpy() -> None:
    xs = [float(x) for x in range(1, 101)]  # 1..100
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 100
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # order of input does not matter
    assert math.isnan(percentile([], 50))
    d = describe([0.001, 0.002, 0.003])
    assert d == {"n": 3, "mean_ms": 2.0, "p50_ms": 2.0, "p90_ms": 2.8, "p99_ms": 2.98, "max_ms": 3.0}


def test_itl_and_tpot_from_token_timestamps() -> None:
    r = req(0, 0.100, [0.010, 0.020, 0.030])  # tokens at 100, 110, 130, 160 ms
    assert r.itls == pytest.approx([0.010, 0.020, 0.030])
    assert r.tpot == pytest.approx((0.160 - 0.100) / 3)
    one = req(1, 0.05, [])
    assert one.itls == [] and one.tpot is None


def test_a_chunk_of_several_tokens_spreads_over_its_gap() -> None:
    times: list[float] = []
    spread_chunk(times, 1.0, 1)  # first token
    spread_chunk(times, 1.3, 3)  # three tokens arrive together 300 ms later
    assert times == pytest.approx([1.0, 1.1, 1.2, 1.3])
    spread_chunk(times, 1.3, 0)
    assert len(times) == 4


def test_summary_throughput_goodput_and_errors() -> None:
    results = [
        req(0, 0.100, [0.010] * 9),  # good
        req(1, 0.300, [0.010] * 9),  # TTFT over SLO
        req(2, 0.100, [0.010] * 8 + [0.200]),  # one stall: over the ITL SLO at quantile 1.0
        RequestResult(3, "short", 0.0, error="http_503"),
        RequestResult(4, "long", 0.0, error="http_503"),
        RequestResult(5, "short", 0.0, error="timeout"),
    ]
    s = summarize(results, wall_s=2.0, slo=Slo(ttft_s=0.2, itl_s=0.05))
    assert (s["requests"], s["completed"], s["failed"]) == (6, 3, 3)
    assert s["errors"] == {"http_503": 2, "timeout": 1}
    assert s["request_throughput"] == 1.5
    assert s["output_token_throughput"] == 15.0
    assert s["total_token_throughput"] == 30.0
    assert s["good_requests"] == 1 and s["goodput"] == 0.5
    assert s["ttft"]["p50_ms"] == pytest.approx(100.0) and s["ttft"]["n"] == 3
    assert s["itl"]["n"] == 27 and s["itl"]["max_ms"] == pytest.approx(200.0)
    # the stall is 1 of 9 gaps: a p80 ITL SLO lets that request through; no SLO: every success is good
    assert summarize(results, 2.0, Slo(0.2, 0.05, itl_quantile=0.8))["good_requests"] == 2
    assert summarize(results, 2.0)["good_requests"] == 3


def test_workloads_have_the_lengths_they_promise() -> None:
    fixed = make_workload(WorkloadConfig(kind="fixed", num_requests=5, input_len=64, output_len=7))
    assert [(s.prompt_len, s.max_tokens) for s in fixed] == [(64, 7)] * 5
    rnd = make_workload(WorkloadConfig(kind="random", num_requests=50, input_len=100, output_len=20))
    assert all(50 <= s.prompt_len <= 100 and 10 <= s.max_tokens <= 20 for s in rnd)
    assert len({s.prompt_len for s in rnd}) > 5
    mixed = make_workload(WorkloadConfig(kind="mixed", num_requests=20, input_len=32, long_input_len=500,
                                         long_every=5, chat=True))
    assert [s.index for s in mixed if s.kind == "long"] == [4, 9, 14, 19]
    assert all(s.prompt_len == 500 for s in mixed if s.kind == "long")
    assert all(s.messages and s.messages[0]["content"] for s in mixed if s.kind == "chat")
    shared = make_workload(WorkloadConfig(kind="shared-prefix", num_requests=30, groups=3, prefix_len=40,
                                          input_len=8))
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for s in shared:
        assert s.group is not None and s.prompt_len == 48
        by_group.setdefault(s.group, set()).add(tuple(s.prompt_ids[:40]))
    assert all(len(prefixes) == 1 for prefixes in by_group.values())
    assert make_workload(WorkloadConfig(kind="random", seed=3)) == make_workload(WorkloadConfig(kind="random", seed=3))
    with pytest.raises(ValueError, match="workload kind"):
        WorkloadConfig(kind="nope")
