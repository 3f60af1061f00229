"""``pdcluster up``'s supervisor on short shell children (no cluster): exit reported with code and log tail,
restart on the same command line after a doubling backoff, the count reset by a stable run, giving up at the cap."""

from __future__ import annotations

import os
import time
from pathlib import Path

from common.app.supervisor import Child, RestartPolicy, Supervisor


def child(tmp_path: Path, script: str) -> Child:
    c = Child("decode-0", ["/bin/sh", "-c", script], dict(os.environ), tmp_path / "decode-0.log", 0)
    c.launch()
    return c


def exited(c: Child, timeout: float = 10.0) -> None:
    c.wait(timeout)
    assert c.exit_code() is not None


def test_a_dead_child_is_reported_restarted_with_backoff_then_given_up(tmp_path: Path) -> None:
    c = child(tmp_path, "echo started $$; exit 3")
    reports: list[str] = []
    sup = Supervisor([c], RestartPolicy(max_restarts=2, backoff_s=1.0, backoff_max_s=1.5, stable_s=60),
                     reports.append)
    first_pid = c.pid
    exited(c)
    t0 = c.started_at + 1.0
    sup.poll(t0)
    assert c.restart_at == t0 + 1.0 and len(reports) == 1
    assert f"decode-0 (pid {first_pid}) exited with code 3" in reports[0]
    assert f"started {first_pid}" in reports[0]  # the tail of its log
    sup.poll(t0 + 0.5)
    assert c.pid == first_pid  # still backing off
    sup.poll(t0 + 1.0)
    assert c.pid != first_pid and c.restarts == 1
    assert reports[-1] == f"decode-0 restarted: pid {c.pid} (restart 1 of 2 in a row)"
    exited(c)
    t1 = c.started_at + 1.0
    sup.poll(t1)
    assert c.restart_at == t1 + 1.5  # doubled, capped at backoff_max_s
    sup.poll(t1 + 1.5)
    exited(c)
    sup.poll(c.started_at + 1.0)
    assert c.given_up and "giving up on it after 2 restarts in a row" in reports[-1]
    sup.poll(c.started_at + 100)
    assert c.restarts == 2 and sup.given_up("decode-0")
    log = c.log.read_text()
    assert log.count("started ") == 3  # every start appends to the one log


def test_a_stable_run_resets_the_count_and_a_live_child_is_left_alone(tmp_path: Path) -> None:
    c = child(tmp_path, "sleep 30")
    reports: list[str] = []
    sup = Supervisor([c], RestartPolicy(max_restarts=1, backoff_s=0.5, stable_s=5), reports.append)
    c.restarts = 1  # as after one quick crash
    pid = c.pid
    sup.poll(c.started_at + 1)
    assert reports == [] and c.restarts == 1
    sup.poll(c.started_at + 6)  # up for stable_s: healthy again
    assert c.restarts == 0
    c.kill_group()
    exited(c)
    now = time.monotonic()
    sup.poll(now)
    assert not c.given_up and c.restart_at == now + 0.5 and "exited with code -9" in reports[0]
    sup.poll(now + 0.5)
    assert c.pid != pid and c.exit_code() is None
    c.terminate()
    exited(c)


def test_no_restarts_with_max_restarts_zero(tmp_path: Path) -> None:
    c = child(tmp_path, "exit 1")
    reports: list[str] = []
    sup = Supervisor([c], RestartPolicy(max_restarts=0), reports.append)
    exited(c)
    sup.poll()
    assert c.given_up and c.restart_at is None and len(reports) == 1
