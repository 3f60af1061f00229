"""The fault-injecting soak (``benchmarks/soak.py``) in its short form, on the tiny model: mixed prompts with
client cancels, a 100-request burst, a decode node SIGKILLed (``up`` restarts it) and the prefill node stalled 5 s.
Every request gets a final status, the burst ends 200 or 429, service comes back after each fault, and every
node ends with its pools free. (RSS growth needs the 10-minute run; the short one only reports it.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

RECOVERY_BOUND_S = 20.0  # the 10-minute target is 10 s; a loaded 2-core CI runner gets twice that


def test_short_soak_loses_nothing_and_recovers_from_each_fault(model_path, tmp_path) -> None:
    out = tmp_path / "soak"
    cmd = [sys.executable, "-m", "benchmarks.soak", "--duration", "30", "--concurrency", "8", "--burst", "100",
           "--stall-s", "5", "--warmup-s", "10", "--long-len", "400", "--tail-s", "10",
           "--model-path", str(model_path), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=Path(__file__).parents[2])
    assert Path(f"{out}.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(Path(f"{out}.json").read_text())
    checks = report["checks"]
    assert report["up_exit_code"] == 0
    assert [f["kind"] for f in report["faults"]] == ["burst", "kill", "stall"]
    # The soak served (how many depends on the cores it gets: 43 under make test's workers, ~120 alone), and every
    # error is one the faults explain: 503 while the only prefill node is stopped (a fast loop gets many), or the
    # client's own cancels.
    assert report["ok"] >= 20, report["errors_by_kind"]
    assert set(report["errors_by_kind"]) <= {"http_503", "client_cancel"}, report["errors_by_kind"]
    assert checks["without_final_status"] == 0, report["errors_by_kind"]
    assert checks["burst_only_200_or_429"], report["faults"][0]
    assert checks["unreachable_nodes"] == [], report["pools"]  # the killed decode node is back (up restarted it)
    assert checks["leaked_pages"] == 0 and checks["stuck_requests"] == 0, report["pools"]
    assert checks["every_fault_recovered"], report["faults"]
    assert checks["service_back_s"] <= RECOVERY_BOUND_S, report["faults"]
    timeline = report["probes"]["timeline"]  # [start, end, ok] per probe: what service_back_s is read from
    assert len(timeline) == report["probes"]["sent"] and sum(ok for _, _, ok in timeline) == report["probes"]["ok"]
    # Load, probes and faults run from the clock's start (building the prompts once blocked the loop for the whole
    # 30 s window on a loaded machine: no request sent, every fault at its end).
    assert timeline[0][0] < 2.0 and report["requests"] > 0, timeline[:3]
    kill = report["faults"][1]
    restarted = (out.parent / "soak-up.log").read_text()
    assert f"{kill['victim']} restarted: pid" in restarted
    assert checks["unexpected_restarts"] == [], restarted  # no node died of a fault it was not given
    assert Path(f"{out}-rss.png").stat().st_size > 0
