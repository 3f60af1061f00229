"""``benchmarks/serving_path.py``'s accounting without a cluster (a full run starts three and takes minutes): the
process tree of an ``up``-shaped parent is labelled, the CPU seconds of a busy grandchild land on it (not on its
idle parent), a py-spy collapsed profile is summarized, and the per-1,000-token figures add up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.proc_cpu import CpuWindow, cluster_processes, summarize_collapsed
from benchmarks.serving_path import _per_1k

# "up" starts a "node" that starts a "rank" which spins for up to 20 s; each prints its child's pid.
RANK = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 20: pass\n"
NODE = (f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', {RANK!r}])\n"
        "print(p.pid, flush=True)\ntime.sleep(30)\n")
UP = (f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', {NODE!r}], stdout=sys.stdout)\n"
      "print(p.pid, flush=True)\ntime.sleep(30)\n")


def _wait_children(pid: int, n: int) -> None:
    deadline = time.monotonic() + 20
    while len(psutil.Process(pid).children(recursive=True)) < n:
        assert time.monotonic() < deadline, "the fake cluster did not start"
        time.sleep(0.05)


def _spin_at_least(pid: int, seconds: float) -> None:
    p = psutil.Process(pid)
    t0 = sum(p.cpu_times()[:2])
    deadline = time.monotonic() + 15
    while sum(p.cpu_times()[:2]) - t0 < seconds:
        assert time.monotonic() < deadline, "the spinning rank got no CPU"
        time.sleep(0.05)


def test_cpu_lands_on_the_busy_rank_of_a_labelled_tree() -> None:
    up = subprocess.Popen([sys.executable, "-c", UP], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert up.stdout is not None
        node_pid = int(up.stdout.readline())
        rank_pid = int(up.stdout.readline())
        _wait_children(up.pid, 2)
        procs = cluster_processes(up.pid, {"null-0": node_pid})
        assert {(p.label, p.category, p.pid) for p in procs} == {
            ("up", "up", up.pid), ("null-0", "front", node_pid), ("null-0/rank0", "rank", rank_pid)}
        cpu = CpuWindow(procs)
        _spin_at_least(rank_pid, 0.5)  # before the window: not counted
        cpu.start()
        _spin_at_least(rank_pid, 0.3)  # CPU seconds, however long a busy machine takes to give them
        window = cpu.stop()
        rank_total = sum(psutil.Process(rank_pid).cpu_times()[:2])
    finally:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait(10)
    rows = {r["label"]: r for r in window["processes"]}
    # /proc counts CPU in 10 ms ticks (and 0.83 - 0.5 < 0.33 in floats): a tick of slack at the upper bound.
    assert 0.3 <= rows["null-0/rank0"]["cpu_s"] <= rank_total - 0.5 + 0.011
    assert rows["null-0"]["cpu_s"] < 0.1 and rows["up"]["cpu_s"] < 0.1  # sleeping parents
    # The busy thread, named from /proc, carries most of its process's CPU (not all: the rank's other threads run a
    # little, and each count is read in 10 ms ticks; CI once read 0.29 s for the thread of a 0.3 s spin).
    assert rows["null-0/rank0"]["threads"][0]["cpu_s"] >= 0.8 * rows["null-0/rank0"]["cpu_s"]
    assert rows["null-0/rank0"]["threads"][0]["name"].startswith("python")

    per_1k = _per_1k(window | {"processes": [*window["processes"], {"label": "client", "category": "client",
                                                                     "pid": 1, "cpu_s": 5.0}]}, 500)
    total = sum(r["cpu_s"] for r in window["processes"])
    assert per_1k["cluster"] == pytest.approx(total * 2, abs=0.01)  # the client is not the cluster's
    assert per_1k["per_category"]["client"] == 10.0
    assert per_1k["front_side_share"] == pytest.approx(rows["null-0"]["cpu_s"] / total, abs=1e-3)


def test_collapsed_profile_summary(tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text("thread (1): fwd;run (a.py:1);mm (b.py:7) 5\n"
                   "thread (1): fwd;run (a.py:2);mm (b.py:9) 3\n"
                   "thread (2): loop;run (a.py:1);poll (c.py:3) 2\n")
    s = summarize_collapsed(raw)
    assert s["samples"] == 10
    assert s["top_self"][0] == ("mm (b.py)", 8)  # line numbers dropped: one frame, both stacks
    assert dict(s["top_inclusive"])["run (a.py)"] == 10
    assert s["threads"] == {"thread (1): fwd": 8, "thread (2): loop": 2}
