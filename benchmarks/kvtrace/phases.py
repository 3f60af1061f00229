"""Where one KV request's time goes: a kvtrace (``sitecustomize.py`` here) read back request by request.

    python -m benchmarks.kvtrace.phases --run --device cuda --backend shm --json out.json   # trace a run, then read it
    python -m benchmarks.kvtrace.phases /tmp/kvt                                            # read an earlier trace

``--run`` runs ``benchmarks.kv_transfer`` (one request in flight at a time, ``--reps`` requests, no rounds) with the
trace on, i.e. ``KVTRACE_DIR=<dir> PYTHONPATH=benchmarks/kvtrace:$PYTHONPATH``. For each ``KVSender.send``, the first
time each later event of the request's path was seen, in both processes, as milliseconds after the send began; the
table gives the median and range over the requests (the first two, warm-up, left out). Consecutive rows are the
path's phases: the send, the hand-off to the peer's worker, the backend's ``_move`` (for ``shm`` on CUDA: the page
ids, the copy's launch), the landing's wait, the report to the control thread, the ``ChunkDone`` hop to decode,
decode's handling, its ``Status`` hop back; with landing signals (``shm``'s default) the ``ChunkDone`` leaves from
``job_enqueued`` (the copy enqueued) and reaches decode at ``landing.chunk``, alongside the landing's own report. The trace's own stamps cost a few µs each: read gaps, not totals.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PATH = ("KVSender.send >", "KVSender.send <", "_move >", "page_ids >", "page_ids <", "copy_pages >", "copy_pages <",
        "job_enqueued >", "job_enqueued <", "landing.chunk >", "landing.chunk <",
        "_move <", "workers._report >", "on_job_done >", "workers._report <", "job_done >", "job_done <",
        "decode._chunk_done >", "decode._chunk_done <", "prefill.handle >", "prefill.handle <")
WARMUP = 2


def read(trace_dir: Path) -> list[tuple[float, str]]:
    """(wall time, "event >|<") of every trace line of every process, in time order (``*._move`` as ``_move``)."""
    events = []
    for path in trace_dir.glob("t.*"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                event = "_move" if parts[3].endswith("._move") else parts[3]
                events.append((float(parts[0]), f"{event} {parts[4]}"))
    return sorted(events)


def requests(events: list[tuple[float, str]]) -> list[dict[str, float]]:
    """Per send, the first time of each event of ``PATH`` after it (before the next send)."""
    out: list[dict[str, float]] = []
    for t, event in events:
        if event == PATH[0]:
            out.append({event: t})
        elif out and event in PATH and event not in out[-1]:
            out[-1][event] = t
    return out


def phases(reqs: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Per event of ``PATH`` seen: ms after the send began, median / min / max over the requests after warm-up, in
    the order of their medians (with landing signals a ChunkDone reaches decode before the copy's own report)."""
    rows = []
    for event in PATH:
        ms = [(r[event] - r[PATH[0]]) * 1e3 for r in reqs[WARMUP:] if event in r]
        if ms:
            rows.append({"event": event, "median_ms": round(statistics.median(ms), 3), "min_ms": round(min(ms), 3),
                         "max_ms": round(max(ms), 3), "requests": len(ms)})
    return sorted(rows, key=lambda row: row["median_ms"])


def table(rows: list[dict[str, Any]], requests_seen: int) -> str:
    lines = [f"{requests_seen} requests ({WARMUP} warm-up left out); ms after the send began: median [min .. max]"]
    lines += [f"  {r['event']:24s} {r['median_ms']:7.3f}  [{r['min_ms']:.3f} .. {r['max_ms']:.3f}]" for r in rows]
    return "\n".join(lines)


def run(a: argparse.Namespace) -> Path:
    """Trace one ``kv_transfer`` run; returns the trace's directory."""
    trace_dir = Path(tempfile.mkdtemp(prefix="kvtrace-"))
    env = {**os.environ, "KVTRACE_DIR": str(trace_dir),
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-m", "benchmarks.kv_transfer", "--device", a.device, "--backends", a.backend, "--modes",
           "paged", "--inflight", "1", "--reps", str(a.reps), "--rounds", "1", "--tokens", str(a.tokens)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=a.timeout)
    return trace_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir", nargs="?", help="a trace to read (without --run)")
    p.add_argument("--run", action="store_true", help="run benchmarks.kv_transfer with the trace on first")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="shm")
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--timeout", type=float, default=120.0, help="--run: the traced run's deadline (seconds)")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    if a.run == bool(a.trace_dir):
        p.error("give either a trace directory or --run")
    trace_dir = run(a) if a.run else Path(a.trace_dir)
    reqs = requests(read(trace_dir))
    rows = phases(reqs)
    print(table(rows, len(reqs)))
    if a.json:
        Path(a.json).write_text(json.dumps({"device": a.device, "backend": a.backend, "tokens": a.tokens,
                                            "requests": len(reqs), "trace_dir": str(trace_dir), "phases": rows},
                                           indent=2) + "\n")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
