"""Per-request failure lines with an outage's repeats folded (router/failure_log.py): the first failure of each kind
logged as before, repeats within the window counted into one line when it ends, none lost."""

from __future__ import annotations

import asyncio
import logging

import openai
import pytest

from router import failure_log
from router.failure_log import FailureLog
from router.testing import eventually, fleet

LOGGER = "test.failures"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_repeats_within_the_window_fold_into_one_line_per_window(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = _Clock()
    log = FailureLog(logging.getLogger(LOGGER), window_s=10.0, clock=clock)
    for i in range(50):
        log.failed(f"r{i}", "UNAVAILABLE", "no routable prefill worker")
    log.failed("x", "DEADLINE_EXCEEDED", "deadline passed")  # another kind: its own line at once
    assert _lines(caplog) == ["[rid=r0] failed: UNAVAILABLE: no routable prefill worker",
                              "[rid=x] failed: DEADLINE_EXCEEDED: deadline passed"]
    clock.now += 10.0
    log.failed("r50", "UNAVAILABLE", "no routable prefill worker")  # the next window: the count, then its first
    assert _lines(caplog)[2:] == [
        "49 more requests failed the same way within 10 s (the last: rid=r49): UNAVAILABLE: no routable prefill worker",
        "[rid=r50] failed: UNAVAILABLE: no routable prefill worker"]
    log.failed("r51", "UNAVAILABLE", "no routable prefill worker")
    log.close()
    assert _lines(caplog)[4:] == [
        "1 more requests failed the same way within 10 s (the last: rid=r51): UNAVAILABLE: no routable prefill worker"]


async def test_a_window_is_counted_when_it_ends_even_with_no_later_failure(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    log = FailureLog(logging.getLogger(LOGGER), window_s=0.2)
    for i in range(3):
        log.failed(f"r{i}", "UNAVAILABLE", "down")
    assert len(_lines(caplog)) == 1
    await eventually(lambda: len(_lines(caplog)) == 2, timeout=2.0)
    assert _lines(caplog)[1].startswith("2 more requests failed the same way")


def test_kinds_held_at_once_are_bounded(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failure_log, "MAX_KINDS", 4)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    log = FailureLog(logging.getLogger(LOGGER), clock=_Clock())
    for i in range(20):
        log.failed(f"r{i}", "INTERNAL", f"room {i} failed")
        log.failed(f"r{i}b", "INTERNAL", f"room {i} failed")  # folded into its kind's window
    assert len(log._windows) <= 4
    log.close()
    # every failed request is in the log: its own line or a count
    lines = _lines(caplog)
    assert sum(1 for m in lines if m.startswith("[rid=")) + sum(
        int(m.split()[0]) for m in lines if m[0].isdigit()) == 40


async def test_an_outage_logs_its_first_failure_then_a_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="router.pipeline")
    async with fleet(prefill=1, decode=1) as f:
        await f.prefill[0].stop()
        await eventually(lambda: not any(w.healthy for w in f.server.service.registry if w.role == "prefill"))
        client = f.openai()

        async def fail() -> None:
            with pytest.raises(openai.APIStatusError):
                await client.completions.create(model="mock-model", prompt="hi", max_tokens=2)

        await asyncio.gather(*(fail() for _ in range(20)))
    lines = [r.getMessage() for r in caplog.records if r.name == "router.pipeline"]
    assert len(lines) == 2, lines  # the first request's line, and the count the router's stop wrote
    assert "failed: UNAVAILABLE: no routable prefill worker" in lines[0]
    assert lines[1].startswith("19 more requests failed the same way")


async def test_aborts_that_fail_alike_log_once_then_a_count(caplog: pytest.LogCaptureFixture) -> None:
    """Every abort sent to a stalled node fails the same way: one line, then a count, not a line per request."""
    import grpc

    from router.attempts.legs import Aborter
    from router.metrics import RouterMetrics

    class _Stub:
        async def Abort(self, request: object, timeout: float) -> None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Deadline Exceeded")

    class _Worker:
        address, role, stub = "127.0.0.1:1", "prefill", _Stub()

    caplog.set_level(logging.WARNING, logger="router.attempts.legs")
    aborter = Aborter(1.0, RouterMetrics())
    for i in range(30):
        aborter.abort(_Worker(), f"r{i}")  # type: ignore[arg-type]
    await aborter.drain(5.0)
    aborter.failures.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "router.attempts.legs"]
    assert lines == ["[rid=r0] Abort failed: DEADLINE_EXCEEDED: on 127.0.0.1:1: Deadline Exceeded",
                     "29 more Abort calls failed the same way within 10 s (the last: rid=r29): DEADLINE_EXCEEDED: "
                     "on 127.0.0.1:1: Deadline Exceeded"], lines
