"""The seeds' ``Prefill batch.`` and ``Decode batch.`` lines: every field, in SGLang's order, with the values of
what the scheduler did (requests and tokens per batch, prefix hits, KV slots held, retractions, interval)."""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from common.engine.scheduler_metrics import (
    DecodeStats,
    DisaggQueueCounts,
    PrefillStats,
    format_decode_line,
    format_prefill_line,
)
from tests.conftest import assert_scheduler_pools_released
from tests.engine.test_engine import overlap_flags
from tests.model_fixtures import make_tiny_model

INT = r"(\d+)"
FLOAT = r"(\d+\.\d{2})"
PREFILL_RE = re.compile(
    rf"^Prefill batch\. #new-seq: {INT}, #new-token: {INT}, #cached-token: {INT}, token usage: {FLOAT}, "
    rf"#running-req: {INT}, #queue-req: {INT}(?:, #bootstrap-req: {INT}, #inflight-req: {INT})?$"
)
DECODE_RE = re.compile(
    rf"^Decode batch\. #running-req: {INT}, #token: {INT}, token usage: {FLOAT}, "
    rf"(?:#prealloc-req: {INT}, #transfer-req: {INT}, )?#retracted-req: {INT}, gen throughput \(token/s\): {FLOAT}$"
)
PREFILL_KEYS = ("new_seq", "new_token", "cached_token", "usage", "running", "queue", "bootstrap", "inflight")
DECODE_KEYS = ("running", "token", "usage", "prealloc", "transfer", "retracted", "throughput")


def parse(pattern: re.Pattern[str], keys: tuple[str, ...], messages: list[str]) -> list[dict[str, float | None]]:
    rows = []
    prefix = pattern.pattern[1:15].replace("\\", "")
    for msg in messages:
        if not msg.startswith(prefix):
            continue
        m = pattern.match(msg)
        assert m is not None, f"malformed line: {msg!r}"
        rows.append({k: None if v is None else float(v) for k, v in zip(keys, m.groups(), strict=True)})
    return rows


def lines(caplog: pytest.LogCaptureFixture) -> tuple[list[dict[str, float | None]], list[dict[str, float | None]]]:
    msgs = [r.getMessage() for r in caplog.records if r.name == "common.engine.scheduler"]
    return parse(PREFILL_RE, PREFILL_KEYS, msgs), parse(DECODE_RE, DECODE_KEYS, msgs)


def greedy(n: int) -> dict[str, object]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llama() -> Path:
    return make_tiny_model("llama")


def test_formatters_field_order_per_role() -> None:
    colocated = format_prefill_line(PrefillStats(3, 120, 64, 0.256, 5, 2))
    assert colocated == (
        "Prefill batch. #new-seq: 3, #new-token: 120, #cached-token: 64, token usage: 0.26, #running-req: 5, "
        "#queue-req: 2"
    )
    prefill = format_prefill_line(PrefillStats(1, 7, 0, 0.5, 0, 4, DisaggQueueCounts(bootstrap=6, inflight=2)))
    assert prefill.endswith("#queue-req: 4, #bootstrap-req: 6, #inflight-req: 2")
    decode = format_decode_line(DecodeStats(9, 300, 0.125, 1, 87.654, DisaggQueueCounts(prealloc=4, transfer=3)))
    assert decode == (
        "Decode batch. #running-req: 9, #token: 300, token usage: 0.12, #prealloc-req: 4, #transfer-req: 3, "
        "#retracted-req: 1, gen throughput (token/s): 87.65"
    )
    assert format_decode_line(DecodeStats(1, 2, 0.0, 0, 1.0)).startswith(
        "Decode batch. #running-req: 1, #token: 2, token usage: 0.00, #retracted-req: 0,"
    )
    for line in (colocated, prefill):
        assert PREFILL_RE.match(line)
    assert DECODE_RE.match(decode)


@pytest.mark.parametrize("overlap", [True, False])
def test_colocated_lines_match_what_ran(engine_factory, llama, caplog, overlap) -> None:
    caplog.set_level(logging.INFO, logger="common.engine.scheduler")
    total, interval, n = 2048, 3, 12
    engine = engine_factory(llama, page_size=1, max_total_tokens=total, decode_log_interval=interval,
                            **overlap_flags(overlap))
    prompt = list(range(10, 10 + 40))
    engine.generate(input_ids=prompt, sampling_params=greedy(n))
    prefill, decode = lines(caplog)
    assert len(prefill) == 1
    assert prefill[0] == {"new_seq": 1, "new_token": 40, "cached_token": 0, "usage": prefill[0]["usage"],
                          "running": 0, "queue": 0, "bootstrap": None, "inflight": None}
    # The first token comes from the prefill; n - 1 decode steps follow, a line after every third.
    assert len(decode) == (n - 1) // interval
    for k, row in enumerate(decode, start=1):
        # The prompt's slots plus one per decode step so far; with overlap the next step is launched already.
        held = len(prompt) + k * interval + overlap
        assert row["running"] == 1 and row["token"] == held
        assert row["usage"] == round(held / total, 2)
        assert row["prealloc"] is None and row["transfer"] is None and row["retracted"] == 0
        assert row["throughput"] is not None and row["throughput"] > 0

    caplog.clear()
    shared = [*prompt[:32], 900, 901, 902]
    other = list(range(500, 520))
    engine.generate(input_ids=[shared, other], sampling_params=greedy(2))
    prefill, _ = lines(caplog)
    assert sum(r["new_seq"] or 0 for r in prefill) == 2
    assert sum(r["cached_token"] or 0 for r in prefill) == 32, "the radix hit is the shared 32-token prefix"
    assert sum(r["new_token"] or 0 for r in prefill) == len(shared) - 32 + len(other)


def test_chunked_prefill_counts_each_chunk_once(engine_factory, llama, caplog) -> None:
    caplog.set_level(logging.INFO, logger="common.engine.scheduler")
    engine = engine_factory(llama, page_size=1, chunked_prefill_size=32, decode_log_interval=1000)
    engine.generate(input_ids=list(range(10, 110)), sampling_params=greedy(2))
    prefill, decode = lines(caplog)
    assert [r["new_token"] for r in prefill] == [32, 32, 32, 4]
    assert all(r["cached_token"] == 0 and r["new_seq"] == 1 for r in prefill), "earlier chunks are not hits"
    assert decode == []


def test_retractions_are_reported_per_interval(engine_factory, llama, caplog) -> None:
    caplog.set_level(logging.INFO, logger="common.engine.scheduler")
    rng = random.Random(11)  # test_engine's retraction workload
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in (30, 45, 20, 60, 35, 50, 25, 40)]
    engine = engine_factory(llama, max_total_tokens=400, page_size=1, disable_radix_cache=True, decode_log_interval=1)
    engine.generate(input_ids=prompts, sampling_params=greedy(48))
    prefill, decode = lines(caplog)
    assert engine.scheduler.decode.num_retracted > 0, "the KV budget was meant to force a retraction"
    assert sum(r["retracted"] or 0 for r in decode) == engine.scheduler.decode.num_retracted
    assert sum(r["new_seq"] or 0 for r in prefill) == len(prompts) + engine.scheduler.decode.num_retracted
    assert all(r["throughput"] is not None and r["throughput"] > 0 for r in decode)
    assert max(r["running"] or 0 for r in decode) > 1


def test_pd_roles_report_their_queues(llama, caplog, monkeypatch) -> None:
    """A prefill and a decode scheduler in this process, TCP transfer on 127.0.0.1: each line carries its role's
    queue fields, and the decode node's lines count only the requests whose KV arrived."""
    import time

    from common.config import ServerArgs
    from common.engine.io_struct import GenerateReqInput, PrefillDone, TokenOut
    from common.engine.sampling.params import SamplingParams
    from common.engine.scheduler import Scheduler
    from common.text.tokenizer import load_tokenizer
    from decode_node.role import DecodeRole
    from kvtransfer.bootstrap import BootstrapServer
    from prefill_node.role import PrefillRole

    monkeypatch.setenv("PDCLUSTER_CLUSTER_TOKEN", "test-cluster-token")
    caplog.set_level(logging.INFO, logger="common.engine.scheduler")
    bootstrap = BootstrapServer("test-cluster-token")  # served by the prefill front in a real node
    port = bootstrap.start()
    base = ServerArgs(model_path=str(llama), page_size=1, max_total_tokens=2048, max_running_requests=16,
                      disaggregation_bootstrap_port=port, decode_log_interval=2, disable_overlap_schedule=True)
    tokenizer = load_tokenizer(str(llama))
    prefill_out: list[object] = []
    decode_out: list[object] = []
    pargs, dargs = base.replace(disaggregation_mode="prefill"), base.replace(disaggregation_mode="decode")
    prefill = Scheduler(pargs, str(llama), tokenizer, prefill_out.extend, role=PrefillRole(pargs))
    decode = Scheduler(dargs, str(llama), tokenizer, decode_out.extend, role=DecodeRole(dargs))
    try:
        n, new = 3, 9
        prompts = [list(range(10 + 100 * i, 30 + 100 * i)) for i in range(n)]
        msgs = [GenerateReqInput(rid=f"r{i}", input_ids=p, sampling_params=SamplingParams(**greedy(new)),
                                 bootstrap_room=1000 + i, bootstrap_addr=f"127.0.0.1:{port}")
                for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 120

        def run_until(done: Callable[[], bool]) -> None:
            while not done():
                assert time.monotonic() < deadline, "the PD pair did not finish in 120 s"
                prefill.step([])
                decode.step([])

        def finished() -> list[TokenOut]:
            return [m for m in decode_out if isinstance(m, TokenOut) and m.finish_reason is not None]

        # r0 on both nodes; r1 only on the prefill node (it waits there for its decode peer, in the bootstrap
        # queue); r2 only on the decode node (it waits there for its KV, in the prealloc or transfer queue).
        decode.step([msgs[0], msgs[2]])
        prefill.step([msgs[0], msgs[1]])
        run_until(lambda: len(finished()) == 1)
        prefill_lines, decode_lines = lines(caplog)
        assert [(r["new_seq"], r["new_token"], r["bootstrap"], r["inflight"]) for r in prefill_lines] == [
            (1, len(prompts[0]), 1, 0)
        ]
        interval = decode.args.decode_log_interval
        assert len(decode_lines) == (new - 1) // interval  # the first token came from the prefill node
        for k, row in enumerate(decode_lines, start=1):
            r0_running = k * interval < new - 1  # r0 finishes at its last decode step and frees its KV
            assert row["running"] == int(r0_running)
            # r0's prompt plus one slot per decode step, and r2's prompt slots once preallocated (transfer queue)
            r2_held = len(prompts[2]) if row["transfer"] == 1 else 0
            assert row["token"] == r2_held + (len(prompts[0]) + k * interval if r0_running else 0)
            assert (row["prealloc"] or 0) + (row["transfer"] or 0) == 1, "r2 waits for its KV"
            assert row["throughput"] is not None and row["throughput"] > 0

        caplog.clear()
        decode.step([msgs[1]])
        prefill.step([msgs[2]])
        run_until(lambda: prefill.is_idle() and decode.is_idle())
        assert len(finished()) == n and all(m.error is None for m in finished()), finished()
        assert len([m for m in prefill_out if isinstance(m, PrefillDone) and m.error is None]) == n, prefill_out
        prefill_lines, decode_lines = lines(caplog)
        assert sum(r["new_seq"] or 0 for r in prefill_lines) == n - 1
        assert sum(r["new_token"] or 0 for r in prefill_lines) == len(prompts[1]) + len(prompts[2])
        assert decode_lines and all(r["prealloc"] is not None and r["throughput"] for r in decode_lines)
        assert_scheduler_pools_released(prefill, decode)
    finally:
        prefill.close()
        decode.close()
        bootstrap.stop()


def test_decode_interval_throughput_is_tokens_over_busy_wall_time(monkeypatch) -> None:
    import common.engine.scheduler_metrics as metrics

    clock = iter([100.0, 160.0, 162.0, 164.0])  # construction, restart after a minute idle, take, take
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    interval = metrics.DecodeLogInterval(2)
    interval.tokens, interval.retracted = 7, 0  # tokens before the idle minute belong to no line
    interval.restart()
    due = []
    for _ in range(4):
        due.append(interval.on_decode_step())
        interval.tokens += 3
    assert due == [False, True, False, True]
    interval.retracted = 2
    assert interval.take() == (12 / 2.0, 2, None)
    interval.tokens, interval.verify_steps, interval.verify_tokens = 5, 2, 7
    assert interval.take() == (5 / 2.0, 0, 3.5)
