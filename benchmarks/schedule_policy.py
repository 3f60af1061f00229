"""Scheduling policies and priorities on a saturated colocated ``Engine`` (the tiny generated Llama, CPU).

Two workloads, each against its baseline measured in the same run:

  shared prefix   --systems system prompts x --users users each (prompt = system prompt + a user turn), shuffled,
                  all submitted at once to a KV cache smaller than the system prompts together. ``fcfs`` vs ``lpm``:
                  prompt tokens served from the radix cache, TTFT p50 (scheduler arrival -> first token), wall time.
  priorities      --batch low-priority requests submitted at once, then --interactive short high-priority requests
                  one every --gap-s while the batch runs. With --enable-priority-scheduling (priority 0 vs 100) vs
                  without (the same requests, no priority): TTFT p99 per class and output tokens/s of the whole run.

    .venv/bin/python -m benchmarks.schedule_policy                        # defaults: 8 x 64; 256 batch + 16 interactive
    .venv/bin/python -m benchmarks.schedule_policy --json benchmarks/results/schedule_policy.json

Ratios are what to read (this run's policy / this run's baseline); absolute figures depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def engine(model: str, ns: argparse.Namespace, **flags: Any) -> Any:
    from common.node.engine import Engine

    return Engine(model_path=model, max_total_tokens=ns.max_total_tokens, max_running_requests=ns.max_running,
                  torch_num_threads=ns.threads, **flags)


def shared_prefix(model: str, ns: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(ns.seed)
    systems = [[rng.randrange(10, 1000) for _ in range(ns.system_len)] for _ in range(ns.systems)]
    prompts = [s + [rng.randrange(10, 1000) for _ in range(ns.user_len)] for s in systems for _ in range(ns.users)]
    rng.shuffle(prompts)
    sp = {"max_new_tokens": ns.output_len, "temperature": 0.0, "ignore_eos": True}
    out: dict[str, Any] = {}
    for policy in ("fcfs", "lpm"):
        with engine(model, ns, schedule_policy=policy) as e:
            start = time.monotonic()
            results = e.generate(input_ids=prompts, sampling_params=sp, timeout=3600)
            wall = time.monotonic() - start
        ttfts = [r.timing.ttft for r in results]
        out[policy] = {"cached_tokens": sum(r.cached_tokens for r in results),
                       "prompt_tokens": sum(len(p) for p in prompts), "ttft_p50_s": statistics.median(ttfts),
                       "ttft_p99_s": percentile(ttfts, 0.99), "wall_s": wall}
        print(policy, json.dumps(out[policy]), flush=True)
    out["lpm_vs_fcfs"] = {"cached_tokens": out["lpm"]["cached_tokens"] / max(1, out["fcfs"]["cached_tokens"]),
                          "ttft_p50": out["lpm"]["ttft_p50_s"] / out["fcfs"]["ttft_p50_s"],
                          "wall": out["lpm"]["wall_s"] / out["fcfs"]["wall_s"]}
    return out


def mixed(model: str, ns: argparse.Namespace, priorities: bool) -> dict[str, Any]:
    rng = random.Random(ns.seed + 1)
    batch = [[rng.randrange(10, 1000) for _ in range(ns.batch_len)] for _ in range(ns.batch)]
    inter = [[rng.randrange(10, 1000) for _ in range(ns.interactive_len)] for _ in range(ns.interactive)]
    lo_sp = {"max_new_tokens": ns.batch_output_len, "temperature": 0.0, "ignore_eos": True}
    hi_sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    hi_ttft: list[float] = []
    lo: list[Any] = []
    with engine(model, ns, enable_priority_scheduling=priorities) as e:
        start = time.monotonic()
        runner = threading.Thread(target=lambda: lo.extend(e.generate(
            input_ids=batch, sampling_params=lo_sp, timeout=3600, priority=0 if priorities else None)))
        runner.start()
        time.sleep(ns.gap_s)
        for p in inter:
            r = e.generate(input_ids=p, sampling_params=hi_sp, timeout=3600, priority=100 if priorities else None)
            hi_ttft.append(r.timing.ttft)
            time.sleep(ns.gap_s)
        runner.join()
        wall = time.monotonic() - start
    lo_ttft = [r.timing.ttft for r in lo]
    tokens = sum(len(r.output_ids) for r in lo) + 4 * len(inter)
    return {"hi_ttft_p99_s": percentile(hi_ttft, 0.99), "lo_ttft_p99_s": percentile(lo_ttft, 0.99),
            "hi_ttft_p50_s": statistics.median(hi_ttft), "output_tok_s": tokens / wall, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the tiny generated Llama")
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=128)
    ap.add_argument("--user-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batch-len", type=int, default=64)
    ap.add_argument("--batch-output-len", type=int, default=32)
    ap.add_argument("--interactive", type=int, default=16)
    ap.add_argument("--interactive-len", type=int, default=16)
    ap.add_argument("--gap-s", type=float, default=0.2)
    ap.add_argument("--max-total-tokens", type=int, default=640, help="smaller than the system prompts together")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", choices=("shared", "mixed"), action="append", default=[])
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    from common.text.tokenizer import resolve_model_path

    model = str(resolve_model_path(ns.model_path))
    report: dict[str, Any] = {"args": vars(ns)}
    if "shared" not in ns.skip:
        report["shared_prefix"] = shared_prefix(model, ns)
        print("shared prefix, lpm / fcfs:", json.dumps(report["shared_prefix"]["lpm_vs_fcfs"]), flush=True)
    if "mixed" not in ns.skip:
        fcfs, prio = mixed(model, ns, False), mixed(model, ns, True)
        report["priorities"] = {"fcfs": fcfs, "priority": prio, "ratios": {
            "hi_p99_over_lo_p99": prio["hi_ttft_p99_s"] / prio["lo_ttft_p99_s"],
            "hi_p99_vs_fcfs_hi_p99": prio["hi_ttft_p99_s"] / fcfs["hi_ttft_p99_s"],
            "throughput_vs_fcfs": prio["output_tok_s"] / fcfs["output_tok_s"]}}
        print("priorities:", json.dumps(report["priorities"], indent=1), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
