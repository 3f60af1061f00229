"""Where one KV request's time goes: a kvtrace (``sitecustomize.py`` here) read back request by request.

    KVTRACE_DIR=/tmp/kvt PYTHONPATH=benchmarks/kvtrace:$PYTHONPATH python -m benchmarks.kv_transfer --backends shm \
        --inflight 1 --reps 12 --rounds 1
    python benchmarks/kvtrace/phases.py /tmp/kvt

For each ``KVSender.send`` (one request in flight at a time: ``--inflight 1``), the first time each later event of
the request's path was seen, in both processes, as milliseconds after the send began; the table gives the median and
range over the requests (the first two, warm-up, left out). Consecutive rows are the path's phases: the send, the
hand-off to the peer's worker, the backend's ``_move`` (for ``shm`` on CUDA: the page ids, the copy's launch), the
landing's wait, the report to the control thread, the ``ChunkDone`` hop to decode, decode's handling, its ``Status``
hop back.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

PATH = ("KVSender.send >", "KVSender.send <", "_move >", "page_ids >", "page_ids <", "copy_pages >", "copy_pages <",
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


def table(reqs: list[dict[str, float]]) -> str:
    lines = [f"{len(reqs)} requests ({WARMUP} warm-up left out); ms after the send began: median [min .. max]"]
    for event in PATH:
        ms = [(r[event] - r[PATH[0]]) * 1e3 for r in reqs[WARMUP:] if event in r]
        if ms:
            lines.append(f"  {event:24s} {statistics.median(ms):7.3f}  [{min(ms):.3f} .. {max(ms):.3f}]")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(requests(read(Path(sys.argv[1])))))
