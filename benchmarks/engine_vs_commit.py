"""``engine_throughput``'s workload three ways in one sitting: this checkout's ``Engine``, the ``Engine`` of an earlier
commit (a ``git worktree`` of ``--base``, removed at the end) and Hugging Face ``generate``, on the same weights.

    .venv/bin/python -m benchmarks.engine_vs_commit --base cd72d8e --repeats 5
    .venv/bin/python -m benchmarks.engine_vs_commit --base cd72d8e --repeats 3 --num-prompts 32 --output-len 64

Each side is a worker process of ``benchmarks.engine_throughput`` (same ``torch.set_num_threads(--threads)``, the
base's worker imports ``common`` from the worktree). Per repeat: fresh prompts (the same for every side), each side
runs the full generate (``--output-len`` tokens) and then, unless ``--skip-prefill``, the prefill-only call
(``max_new_tokens=1``) on other fresh prompts; the order of the sides rotates every repeat, so load drift on a shared
machine hits all three alike. Reported: per-side medians (output tok/s, prefill tok/s, decode step = (full - prefill)
/ (output_len - 1)), and the ratios ours / hf, base / hf, ours / base both of the medians and as the median of the
per-repeat ratios (each repeat's sides ran minutes apart at most), with the load average of every repeat.
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

from benchmarks.engine_sides import Side, machine_facts, random_prompts

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("ours", "base", "hf")


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit to compare with (e.g. where the work started)")
    p.add_argument("--model-size", default="small", help="preset of the generated llama (tiny, small, 1b)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--skip-prefill", action="store_true", help="skip the max_new_tokens=1 prefill runs")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "engine_vs_commit.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = _parse(argv)
    from common.model_gen.make_model import make_model

    n, lin, lout = a.num_prompts, a.input_len, a.output_len
    base = _git("rev-parse", "--short", a.base)
    head = _git("rev-parse", "--short", "HEAD") + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no")
                                                    else "")
    engine_args = {
        "page_size": a.page_size,
        "max_total_tokens": n * (lin + lout + a.page_size),
        "max_running_requests": n,
        "chunked_prefill_size": max(a.page_size, -(-n * lin // a.page_size) * a.page_size),
        "max_prefill_tokens": max(16384, n * lin),
        "torch_num_threads": a.threads,
        "decode_log_interval": 10**9,
        "device": "cpu",
        "dtype": "float32",
    }
    full: dict[str, list[float]] = {k: [] for k in SIDES}
    prefill: dict[str, list[float]] = {k: [] for k in SIDES}
    agree: dict[str, list[float]] = {"ours": [], "base": []}
    loads: list[float] = []
    machine = machine_facts(a.threads)
    with tempfile.TemporaryDirectory(prefix="pdc-engine-vs-commit-") as tmp:
        worktree = Path(tmp) / f"base-{base}"
        _git("worktree", "add", "--detach", str(worktree), base)
        sides: dict[str, Side] = {}
        try:
            model_path = str(make_model("llama", a.model_size, Path(tmp) / "model", seed=0))
            print(f"head {head}, base {base}; workload {n} x {lin} -> {lout}, greedy, {a.repeats} repeats; "
                  f"machine {machine}", flush=True)
            sides = {"ours": Side("ours", model_path, a.threads, engine_args),
                     "base": Side("ours_base", model_path, a.threads, engine_args, root=str(worktree)),
                     "hf": Side("hf", model_path, a.threads, engine_args)}
            warm = random_prompts(10**6, min(n, 8), lin, 8192, low=3)
            for s in sides.values():
                s.run(warm, 4)
            for rep in range(a.repeats):
                order = [SIDES[(i + rep) % 3] for i in range(3)]
                prompts = random_prompts(rep, n, lin, 8192, low=3)
                outs = {}
                for k in order:
                    secs, outs[k] = sides[k].run(prompts, lout)
                    full[k].append(secs)
                for k in ("ours", "base"):
                    agree[k].append(sum(x == y for x, y in zip(outs[k], outs["hf"], strict=True)) / n)
                if not a.skip_prefill:
                    pre = random_prompts(1000 + rep, n, lin, 8192, low=3)
                    for k in order:
                        prefill[k].append(sides[k].run(pre, 1)[0])
                loads.append(os.getloadavg()[0])
                line = "  ".join(f"{k} {n * lout / full[k][-1]:6.0f}" for k in SIDES)
                print(f"repeat {rep} ({' > '.join(order)}): out tok/s {line}; identical to hf: ours "
                      f"{agree['ours'][-1]:.0%} base {agree['base'][-1]:.0%}; load {loads[-1]:.1f}", flush=True)
            rss = {k: s.peak_rss_mib() for k, s in sides.items()}
        finally:
            for s in sides.values():
                s.stop()
            _git("worktree", "remove", "--force", str(worktree))

    def side(k: str) -> dict[str, Any]:
        med = statistics.median(full[k])
        out: dict[str, Any] = {"output_tok_per_s": n * lout / med, "seconds": full[k], "peak_rss_mib": rss[k]}
        if prefill[k]:
            pm = statistics.median(prefill[k])
            out |= {"prefill_tok_per_s": n * lin / pm, "prefill_seconds": prefill[k],
                    "decode_step_ms": (med - pm) / max(1, lout - 1) * 1e3}
        return out

    def ratio(x: str, y: str) -> dict[str, Any]:
        per = [full[y][i] / full[x][i] for i in range(a.repeats)]
        return {"of_medians": statistics.median(full[y]) / statistics.median(full[x]),
                "median_per_repeat": statistics.median(per), "per_repeat": per, "min": min(per), "max": max(per)}

    result = {
        "benchmark": "engine_vs_commit", "head": head, "base": base,
        "workload": {"num_prompts": n, "input_len": lin, "output_len": lout, "repeats": a.repeats, "greedy": True,
                     "model_size": a.model_size},
        "engine_args": engine_args, "machine": machine | {"loadavg_per_repeat": loads},
        "sides": {k: side(k) for k in SIDES},
        "ratios": {"ours/hf": ratio("ours", "hf"), "base/hf": ratio("base", "hf"), "ours/base": ratio("ours", "base")},
        "identical_to_hf_fraction": agree,
    }
    print(f"\n{'':<6} {'out tok/s':>10} {'prefill tok/s':>14} {'decode step ms':>15} {'peak RSS MiB':>13}")
    for k, r in result["sides"].items():
        print(f"{k:<6} {r['output_tok_per_s']:10.0f} {r.get('prefill_tok_per_s', 0):14.0f} "
              f"{r.get('decode_step_ms', 0):15.2f} {r['peak_rss_mib']:13.0f}")
    for name, r in result["ratios"].items():
        print(f"{name:<10} {r['of_medians']:.2f}x of medians; per repeat median {r['median_per_repeat']:.2f}x "
              f"(range {r['min']:.2f}-{r['max']:.2f})")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.json}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
