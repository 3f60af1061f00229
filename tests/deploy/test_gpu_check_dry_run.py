"""``benchmarks/gpu_check.py --dry-run``: the GPU check's whole plumbing on CPU at tiny sizes, so the one command a
lent GPU runs cannot rot between GPU sessions (every step runs, writes its JSON, and the summary reads it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")


def test_gpu_check_dry_run_runs_every_step(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(tmp_path),
                           "--budget-s", "400"], cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "summary.json").read_text())
    steps = result["steps"]
    assert list(steps) == ["scale", "pd", "kv", "engine", "spec", "tests", "host", "kvtrace"]
    for name, step in steps.items():
        assert step["status"] == "ok", f"{name}: {step.get('log_tail', '')[-2000:]}"

    tests = steps["tests"]["data"]
    assert tests["tests"] > 20 and tests["failures"] == tests["errors"] == 0  # collected (skipped on CPU)

    scale = steps["scale"]["data"]["sizes"]["tiny"]  # decode points and prefill, each beside its floor
    assert [(p["batch"], p["context"]) for p in scale["decode"]] == [(1, 32), (1, 96), (4, 32), (4, 96)]
    assert all(p["step_ms"] > 0 and 0 < p["floor_ms"] < p["step_ms"] for p in scale["decode"]), scale["decode"]
    assert [p["tokens"] for p in scale["prefill"]] == [64] and scale["prefill"][0]["tok_per_s"] > 0
    assert "aten::" in scale["decode"][0]["profile"]  # the first missed target's profile (a CPU misses them all)

    engine = steps["engine"]["data"]
    assert engine["engine_args"]["load_format"] == "dummy" and "hf" not in engine
    for side in ("ours", "hf_static"):
        # decode_step_ms = (full run - prefill run) / steps: a difference of two timings, noise on a loaded CI host
        assert engine[side]["output_tok_per_s"] > 0 and isinstance(engine[side]["decode_step_ms"], float), side
    assert min(engine["identical_output_fraction"]) == 1.0  # fp32 on CPU, the same dummy weights: greedy identical
    prof = engine["ours_profile"]
    # the forward thread's ops are recorded: its GEMMs (through oneDNN on packed weights on CPU, else aten's)
    assert prof["steps"] == 4 and any(op in prof["top_by_cpu_time"] for op in GEMM_OPS), prof["top_by_cpu_time"]

    host = steps["host"]["data"]["last_repeat"]["functions"]
    assert host["Scheduler.step"]["calls_per_step"] == 1.0 and host["ModelRunner.launch"]["cpu_ms_per_step"] > 0

    kv = steps["kv"]["data"]["paged x2"]  # two requests in flight at once
    assert kv["shm"] > 0 and kv["memcpy"] > 0 and kv["raw_tcp"] > 0, kv

    runs = steps["pd"]["data"]["runs"]
    assert set(runs) == {"colocated", "pd_tcp"}
    for name, run in runs.items():
        assert "error" not in run, run.get("error")
        assert run["load"]["completed"] == 6 and run["load"]["failed"] == 0, name
        assert run["pools_back"], (name, run["pools_after"])
        assert run["startup_s"] > 0 and all("kv_pool" in node for node in run["nodes"].values()), name
    assert runs["pd_tcp"]["identical_to_colocated"] == 1.0

    trace = steps["kvtrace"]["data"]  # the shm control path traced across both processes, phase by phase
    assert trace["requests"] == 5  # --reps 4 after one warm-up
    events = [p["event"] for p in trace["phases"]]
    for event in ("KVSender.send <", "_move >", "on_job_done >", "job_done >", "decode._chunk_done >",
                  "prefill.handle >"):
        assert event in events, events
    # Events are given to the request whose send came last before them (wall clock, two processes): on a loaded host
    # a request's last hops can fall after the next send, and that request then lacks them.
    assert all(1 <= p["requests"] <= 3 and p["median_ms"] >= 0 for p in trace["phases"]), trace["phases"]

    spec = steps["spec"]["data"]  # NGRAM against plain on the copy workload, dummy weights with attention zeroed
    assert spec["load_format"] == "dummy" and "errors" not in spec, spec.get("errors")
    rows = {(r["size"], r["workload"], r["batch"]): r for r in spec["results"]}
    assert set(rows) == {("tiny", "copy", 1), ("tiny", "copy", 2)}
    for key, row in rows.items():  # fp32: greedy identical; the prompts hold the cycle, so drafts are accepted
        assert row["outputs_equal"] and row["identical_token_share"] == 1.0, key
        assert row["plain"]["tokens_per_s"] > 0 and row["ngram"]["tokens_per_s"] > 0, key
        # (the unmodified tiny model loops too, on a shorter cycle: accept length 4 of 9, a third drafted at batch 2)
        assert row["ngram"]["accept_length"] > 6 and row["ngram"]["drafted_share"] > 0.7, (key, row["ngram"])
    assert spec["prompts"]["tiny"]["copy"]["prompts_in_cycle"] == 1.0, spec["prompts"]
    assert spec["runners"]["tiny"]["copy"] == {"plain": {"decode": "eager"},  # CPU: no graphs asked for
                                               "ngram": {"decode": "eager", "verify": "eager"}}

    page = (tmp_path / "summary.md").read_text()
    for heading in ("## scale: ok", "## tests: ok", "## engine: ok", "## host: ok", "## kv: ok", "## pd: ok",
                    "## kvtrace: ok", "| 4 | 96 |", "## spec: ok", "| tiny | copy | 1 |", "ngram: decode eager"):
        assert heading in page
