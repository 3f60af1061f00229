"""Speculative decoding (NGRAM) against plain decoding on the same requests, in one in-process ``Engine`` each, on CPU.

Three workloads, each at batch 1 (requests one after another) and batch 8 (8 at once), EOS ignored:

  copy   the output repeats spans of the prompt. Random weights never copy, so the target is the generated model
         with its attention outputs zeroed (``common.model_gen.copy_model``): greedy decoding becomes a function of
         the last token and cycles, and each prompt holds that cycle, so the continuation repeats prompt spans.
         The forward costs what the unmodified model's does; what is idealised is the workload: drafts from the
         prompt are right nearly always (the accept length reported says how often), as in code editing or
         extraction where the output quotes the prompt verbatim. It measures how much of the verify's extra
         positions a CPU step absorbs, not how often real text repeats.
  free     the unmodified model on random prompts, greedy: its output does not quote its prompt, but a random model's
           greedy text falls into loops of its own now and then, which NGRAM drafts from the output.
  sampled  the same, sampled (temperature 1, seeded): no repetition to find, so drafts are rare and rejected; this
           measures what speculation costs when it has nothing to find (the target: no slowdown).

Per (workload, batch) the two engines run alternately for ``--repeats`` rounds; the medians of output tokens/s and
of the requests' mean inter-token latency ((e2e - ttft) / (tokens - 1)) are compared as ratios.

    .venv/bin/python -m benchmarks.spec_decode                                   # small model, 5 repeats
    .venv/bin/python -m benchmarks.spec_decode --json benchmarks/results/spec_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def engine(model: str, args: argparse.Namespace, spec: bool) -> Any:
    from common.node.engine import Engine

    extra: dict[str, Any] = {"speculative_algorithm": "NGRAM"} if spec else {}
    if spec and args.num_steps:
        extra["speculative_num_steps"] = args.num_steps
    return Engine(model_path=model, max_total_tokens=32768, max_running_requests=16, page_size=16,
                  disable_overlap_schedule=True, torch_num_threads=args.threads, log_level="warning", **extra)


def prompts(kind: str, model: str, n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of about ``length`` tokens; for ``copy``, random text followed by the model's greedy cycle."""
    rng = random.Random(seed)
    out = [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]
    if kind != "copy":
        return out
    from common.node.engine import Engine

    e = Engine(model_path=model, max_total_tokens=32768, max_running_requests=16, log_level="warning")
    try:  # the continuation of each random text enters the model's cycle; the prompt then holds it
        runs = e.generate(input_ids=[p[: length // 2] for p in out],
                          sampling_params={"max_new_tokens": length - length // 2, "temperature": 0.0,
                                           "ignore_eos": True})
    finally:
        e.shutdown()
    return [p[: length // 2] + r.output_ids for p, r in zip(out, runs, strict=True)]


SAMPLING: dict[str, dict[str, Any]] = {"copy": {"temperature": 0.0}, "free": {"temperature": 0.0},
                                       "sampled": {"temperature": 1.0, "seed": 7}}


def measure(e: Any, kind: str, batch: list[list[int]], new_tokens: int, sequential: bool) -> dict[str, Any]:
    sp = {"max_new_tokens": new_tokens, "ignore_eos": True, **SAMPLING[kind]}
    t0 = time.perf_counter()
    outs = [e.generate(input_ids=p, sampling_params=sp) for p in batch] if sequential else \
        e.generate(input_ids=batch, sampling_params=sp)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.output_ids) for o in outs)
    itl = [(o.timing.e2e - o.timing.ttft) / (len(o.output_ids) - 1) for o in outs]
    verify = sum(o.spec_verify_ct for o in outs)
    accepted = sum(o.spec_accepted_tokens for o in outs)
    return {"tokens_per_s": tokens / wall, "itl_ms": 1000 * statistics.mean(itl),
            "accept_length": 1 + accepted / verify if verify else 0.0,
            "drafted_share": sum(o.spec_draft_tokens for o in outs) / tokens, "outputs": [o.output_ids for o in outs]}


def compare(model: str, kind: str, bs: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    batch = prompts(kind, model, bs, args.prompt_len, vocab, seed=bs)
    plain, spec = engine(model, args, spec=False), engine(model, args, spec=True)
    rows: dict[str, list[dict[str, Any]]] = {"plain": [], "ngram": []}
    try:
        measure(plain, kind, batch, 8, bs == 1)  # warm-up: first-call allocations
        measure(spec, kind, batch, 8, bs == 1)
        for _ in range(args.repeats):
            for name, e in (("plain", plain), ("ngram", spec)):
                rows[name].append(measure(e, kind, batch, args.new_tokens, sequential=bs == 1))
    finally:
        plain.shutdown()
        spec.shutdown()
    same = rows["plain"][0]["outputs"] == rows["ngram"][0]["outputs"]
    # NOTE: sampled draws walk the distribution sorted by probability: a verify's logits (an extend) and a decode's
    # agree to rounding, which can reorder two tokens whose probabilities tie to rounding and change a draw.
    assert same or SAMPLING[kind]["temperature"] > 0, "speculation changed the greedy output"

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    out: dict[str, Any] = {"workload": kind, "batch": bs, "outputs_equal": same}
    for name in rows:
        out[name] = {k: round(med(name, k), 3) for k in ("tokens_per_s", "itl_ms", "accept_length", "drafted_share")}
    out["speedup_tokens_per_s"] = round(out["ngram"]["tokens_per_s"] / out["plain"]["tokens_per_s"], 3)
    out["itl_ratio"] = round(out["ngram"]["itl_ms"] / out["plain"]["itl_ms"], 3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", help="generated model size (tiny, small)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--num-steps", type=int, default=None, help="--speculative-num-steps (default: the flag's)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--workloads", default="copy,free,sampled")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from common.model_gen.copy_model import make_copy_model
    from common.model_gen.make_model import default_model_path

    base = str(default_model_path(size=args.size))
    vocab = json.loads((Path(base) / "config.json").read_text())["vocab_size"]
    tmp = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    models = {"copy": str(make_copy_model(Path(base), tmp / "copy")), "free": base, "sampled": base}
    results = []
    for kind in args.workloads.split(","):
        for bs in (int(b) for b in args.batches.split(",")):
            r = compare(models[kind], kind, bs, args, vocab)
            print(json.dumps(r), flush=True)
            results.append(r)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    report = {"benchmark": "spec_decode", "date": time.strftime("%Y-%m-%d"), "commit": commit.strip(),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "model": args.size,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "threads": args.threads, "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
