"""CPU seconds of a ``pdcluster up`` cluster's processes over a window, and a py-spy profile of one of them.

``cluster_processes`` labels every process of the tree: ``up`` itself, each child it printed (``router``, and the
node fronts ``prefill-0``, ``decode-0``, ``null-0``, ...) and their descendants (a node's scheduler ranks, the
router's tokenizer workers, multiprocessing's resource trackers). ``CpuWindow`` reads each process's user + system
seconds (all its threads) and each thread's, before and after; a process that starts inside the window counts
from zero, one that exits inside it is reported as ``exited`` (its last seconds are lost).
"""

from __future__ import annotations

import collections
import contextlib
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

CATEGORIES = ("up", "router", "tokenizer", "front", "rank", "other", "engine")
PY_SPY_FRAME_LINE = re.compile(r":\d+\)$")


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    label: str  # e.g. "decode-0/rank0"
    category: str  # one of CATEGORIES


def _descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return sorted(psutil.Process(pid).children(recursive=True), key=lambda p: p.pid)
    return []


def _cmdline(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(p.cmdline())
    return ""


def cluster_processes(up_pid: int, children: dict[str, int]) -> list[Proc]:
    """Every live process of ``up``'s tree, labelled; ``children``: the name -> pid lines ``up`` printed."""
    procs = [Proc(up_pid, "up", "up")]
    seen = {up_pid}
    for name, pid in children.items():
        cat = "router" if name == "router" else "front"
        procs.append(Proc(pid, name, cat))
        seen.add(pid)
        sub = "tokenizer" if cat == "router" else "rank"
        i = 0
        for p in _descendants(pid):
            seen.add(p.pid)
            if "resource_tracker" in _cmdline(p):
                procs.append(Proc(p.pid, f"{name}/resource_tracker", "other"))
            else:
                procs.append(Proc(p.pid, f"{name}/{sub}{i}", sub))
                i += 1
    procs += [Proc(p.pid, f"up/other-{p.pid}", "other") for p in _descendants(up_pid) if p.pid not in seen]
    return procs


def _read(pid: int) -> tuple[float, dict[int, float]] | None:
    """(user + system seconds of the process, {thread id: its seconds}); None once it is gone."""
    try:
        p = psutil.Process(pid)
        t = p.cpu_times()
        return t.user + t.system, {th.id: th.user_time + th.system_time for th in p.threads()}
    except psutil.Error:
        return None


def _thread_name(pid: int, tid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    return "?"


@dataclass
class CpuWindow:
    """CPU seconds per process (and its busiest threads) between ``start`` and ``stop``."""

    procs: list[Proc]
    before: dict[int, tuple[float, dict[int, float]]] = field(default_factory=dict)
    t0: float = 0.0

    def start(self) -> None:
        self.before = {p.pid: r for p in self.procs if (r := _read(p.pid)) is not None}
        self.t0 = time.perf_counter()

    def stop(self, top_threads: int = 3) -> dict[str, Any]:
        """{"wall_s", "processes": [{label, category, pid, cpu_s, threads: [{tid, name, cpu_s}]} | {.., exited}]}; a
        thread's tid is the one py-spy's ``thread (tid)`` frames name."""
        wall = time.perf_counter() - self.t0
        rows: list[dict[str, Any]] = []
        for p in self.procs:
            after = _read(p.pid)
            row: dict[str, Any] = {"label": p.label, "category": p.category, "pid": p.pid}
            if after is None:
                rows.append(row | {"cpu_s": None, "exited": True})
                continue
            cpu0, threads0 = self.before.get(p.pid, (0.0, {}))
            per_thread = sorted(((s - threads0.get(tid, 0.0), tid) for tid, s in after[1].items()), reverse=True)
            row["cpu_s"] = round(after[0] - cpu0, 3)
            row["threads"] = [{"tid": tid, "name": _thread_name(p.pid, tid), "cpu_s": round(s, 3)}
                              for s, tid in per_thread[:top_threads] if s > 0]
            rows.append(row)
        return {"wall_s": round(wall, 3), "processes": rows}


def by_category(window: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for row in window["processes"]:
        out[row["category"]] += row["cpu_s"] or 0.0
    return dict(out)


def py_spy_record(py_spy: str, pid: int, seconds: int, out: Path) -> subprocess.Popen[bytes]:
    """Start sampling ``pid`` (collapsed stacks, one line per stack and thread) for ``seconds``; the caller waits
    for it (and ends it by its pid if it overruns)."""
    cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "100", "--format", "raw",
           "--threads", "--nonblocking", "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def summarize_collapsed(path: Path, top: int = 15) -> dict[str, Any]:
    """The busiest frames of a py-spy ``raw`` profile: by self samples (the leaf) and by inclusive samples (any
    stack that holds it), line numbers dropped, plus the samples per thread."""
    self_n: collections.Counter[str] = collections.Counter()
    incl_n: collections.Counter[str] = collections.Counter()
    thread_n: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread, frames = (frames[0], frames[1:]) if frames[0].startswith(("thread ", "process ")) else ("?", frames)
        frames = [PY_SPY_FRAME_LINE.sub(")", f) for f in frames]
        total += n
        thread_n[thread] += n
        if frames:
            self_n[frames[-1]] += n
        for f in set(frames):
            incl_n[f] += n
    return {"samples": total, "threads": dict(thread_n.most_common(8)),
            "top_self": [(f, n) for f, n in self_n.most_common(top)],
            "top_inclusive": [(f, n) for f, n in incl_n.most_common(top)]}
