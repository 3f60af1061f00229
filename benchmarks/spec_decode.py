"""Speculative decoding (NGRAM) against plain decoding on the same requests, in one in-process ``Engine`` each.

Three workloads, each at batch 1 (requests one after another) and batch 8 (8 at once), EOS ignored:

  copy   the output repeats spans of the prompt. Random weights never copy, so the target's attention outputs are
         zeroed (``common.model_gen.copy_model.zero_attention_output_``, in place on the built model, so it works on
         ``--load-format dummy`` weights too): greedy decoding becomes a function of the last token and cycles, and
         each prompt holds that cycle, so the continuation repeats prompt spans. The forward costs what the
         unmodified model's does; what is idealised is the workload: drafts from the prompt are right nearly always
         (the accept length reported says how often), as in code editing or extraction where the output quotes the
         prompt verbatim. It measures how much of the verify's extra positions a step absorbs, not how often real
         text repeats.
  free     the unmodified model on random prompts, greedy: its output does not quote its prompt, but a random model's
           greedy text falls into loops of its own now and then, which NGRAM drafts from the output.
  sampled  the same, sampled (temperature 1, seeded): no repetition to find, so drafts are rare and rejected; this
           measures what speculation costs when it has nothing to find (the target: no slowdown).

Per (size, workload, batch) the two engines run alternately for ``--repeats`` rounds; the medians of output tokens/s
and of the requests' mean inter-token latency ((e2e - ttft) / (tokens - 1)) are compared as ratios. Greedy outputs
are asserted equal in float32; in bf16/fp16 a verify's logits (an extend of draft + 1 rows) and a decode's agree to
the dtype's rounding, which can flip a near-tie, so there the share of identical tokens is recorded instead. On CUDA
the step runners each engine serves with (CUDA graphs, compiled, or eager after a failed start-up check) are recorded.

    .venv/bin/python -m benchmarks.spec_decode                                   # CPU, small model, 5 repeats
    .venv/bin/python -m benchmarks.spec_decode --json benchmarks/results/spec_decode.json
    python3 -m benchmarks.spec_decode --device cuda --dtype bfloat16 --load-format dummy --size 8b,1b \
        --workloads copy --batches 1,8 --repeats 3 --prompt-len 768 --plain-overlap --json $OUT/spec.json  # a GPU
"""

from __future__ import annotations

import argparse
import gc
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

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def engine(model: str, args: argparse.Namespace, spec: bool, copy: bool) -> Any:
    """An engine serving ``model`` with NGRAM (``spec``) or without; ``copy``: its attention outputs zeroed."""
    from common.model_gen.copy_model import zero_attention_output_
    from common.node.engine import Engine

    extra: dict[str, Any] = {"speculative_algorithm": "NGRAM"} if spec else {}
    if spec and args.num_steps:
        extra["speculative_num_steps"] = args.num_steps
    if args.dtype:
        extra["dtype"] = args.dtype
    if args.device == "cuda":
        extra["cuda_graph_max_bs"] = max(args.batch_sizes)
    # A colocated node speculates without the overlap schedule (common/speculative.py); plain decoding as served by default
    # on a GPU overlaps (--plain-overlap), on a CPU whose threads take the cores it would not.
    overlap = args.plain_overlap and not spec
    e = Engine(model_path=model, device=args.device, load_format=args.load_format, max_total_tokens=32768,
               max_running_requests=16, page_size=16, disable_overlap_schedule=not overlap,
               torch_num_threads=args.threads, log_level="warning", **extra)
    if copy:
        zero_attention_output_(e.scheduler.runner.model)
        if args.device == "cuda":
            torch.cuda.synchronize()  # before the scheduler's streams replay graphs over the weights
    return e


def runners(e: Any) -> dict[str, str]:
    """What serves each step kind of the engine: ``cuda_graph``, ``compiled`` or ``eager`` (none asked for, or every
    option failed its start-up check): decode, and with speculation verify, the draft's steps (STANDALONE: the draft
    model's decode; EAGLE: the head's draft steps) and its decode-time extends."""
    r = e.scheduler.runner

    def kind(x: Any) -> str:
        return "eager" if x is None else ("cuda_graph" if x.use_cuda_graph else "compiled")

    out = {"decode": kind(r.graph_runner)}
    if e.args.speculative_algorithm:
        out["verify"] = kind(r.verify_graph_runner)
        from common.engine.spec.eagle import EagleDrafter
        from common.engine.spec.standalone import StandaloneDrafter

        drafter = e.scheduler.decode.speculator.drafter
        if isinstance(drafter, EagleDrafter):
            out["draft"] = kind(drafter.worker.graph_runner)
            out["draft_extend"] = kind(drafter.worker.extend_graph_runner)
        elif isinstance(drafter, StandaloneDrafter):  # the draft model's own runner
            out["draft"] = kind(drafter.runner.graph_runner)
            out["draft_extend"] = kind(drafter.runner.draft_extend_graph_runner)
    return out


def rho(ids: list[int]) -> tuple[int, int]:
    """(tail, cycle) of a sequence each token of which follows from the one before: the cycle starts at ``tail``
    and is ``cycle`` long; (len, 0) where no token repeats yet."""
    first: dict[int, int] = {}
    for i, t in enumerate(ids):
        if t in first:
            return first[t], i - first[t]
        first[t] = i
    return len(ids), 0


def prompts(kind: str, plain: Any, n: int, args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], dict[str, Any]]:
    """``n`` prompts of ``--prompt-len`` random tokens; for ``copy``, half of that followed by the (copy) model's
    greedy continuation of ``--cycle-search`` tokens from where it entered its cycle (one full cycle at least, so
    the output repeats the prompt from its first token), or where no cycle showed, the continuation's last half
    prompt length (NGRAM then finds the cycle only as the output comes round it)."""
    length, rng = args.prompt_len, random.Random(n)
    out = [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]
    if kind != "copy":
        return out, {}
    runs = plain.generate(input_ids=[p[: length // 2] for p in out],
                          sampling_params={"max_new_tokens": max(args.cycle_search, length - length // 2),
                                           "temperature": 0.0, "ignore_eos": True})
    cycles = [rho(r.output_ids) for r in runs]
    kept = [r.output_ids[tail:] if cycle else r.output_ids[-(length - length // 2):]
            for r, (tail, cycle) in zip(runs, cycles, strict=True)]
    return [p[: length // 2] + k for p, k in zip(out, kept, strict=True)], {
        "prompts_in_cycle": sum(c > 0 for _, c in cycles) / n, "cycle_lengths": [c for _, c in cycles]}


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


def identical_share(a: list[list[int]], b: list[list[int]]) -> float:
    """Tokens before each pair of outputs first differs, over all tokens (1.0: identical)."""
    same = sum(next((i for i, (x, y) in enumerate(zip(p, q, strict=False)) if x != y), min(len(p), len(q)))
               for p, q in zip(a, b, strict=True))
    return same / max(1, sum(len(p) for p in a))


def compare(engines: dict[str, Any], kind: str, batch: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    bs = len(batch)
    rows: dict[str, list[dict[str, Any]]] = {"plain": [], "ngram": []}
    for e in engines.values():
        measure(e, kind, batch, 8, bs == 1)  # warm-up: first-call allocations, the prompts' prefill cached alike
    for _ in range(args.repeats):
        for name, e in engines.items():
            rows[name].append(measure(e, kind, batch, args.new_tokens, sequential=bs == 1))
    same = rows["plain"][0]["outputs"] == rows["ngram"][0]["outputs"]
    # NOTE: sampled draws walk the distribution sorted by probability: a verify's logits (an extend) and a decode's
    # agree to rounding, which can reorder two tokens whose probabilities tie to rounding and change a draw; in a
    # half dtype that rounding can flip a greedy near-tie too.
    exact = SAMPLING[kind]["temperature"] == 0 and engines["plain"].scheduler.runner.dtype == torch.float32
    assert same or not exact, "speculation changed the greedy output"

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    out: dict[str, Any] = {"size": args.current_size, "workload": kind, "batch": bs, "outputs_equal": same,
                           "identical_token_share": round(identical_share(rows["plain"][0]["outputs"],
                                                                          rows["ngram"][0]["outputs"]), 4)}
    for name in rows:
        out[name] = {k: round(med(name, k), 3) for k in ("tokens_per_s", "itl_ms", "accept_length", "drafted_share")}
    out["speedup_tokens_per_s"] = round(out["ngram"]["tokens_per_s"] / out["plain"]["tokens_per_s"], 3)
    out["itl_ratio"] = round(out["ngram"]["itl_ms"] / out["plain"]["itl_ms"], 3)
    return out


def model_folder(size: str, args: argparse.Namespace, tmp: Path) -> str:
    """The generated llama of ``size``: the cached folder with weights, or config and tokenizer only (dummy)."""
    from common.model_gen.make_model import default_model_path, make_model

    if args.load_format == "dummy":
        return str(make_model("llama", size, tmp / size, weights=False))
    return str(default_model_path(size=size))


def run_size(size: str, args: argparse.Namespace, tmp: Path, report: dict[str, Any]) -> None:
    """Every workload of ``size`` into ``report``, written to ``--json`` after each row (a deadline keeps what ran)."""
    model = model_folder(size, args, tmp)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    args.current_size = size
    for key in ("runners", "startup_s", "prompts"):
        report[key][size] = {}
    for kind in args.workloads.split(","):
        t0 = time.monotonic()
        engines = {"plain": engine(model, args, spec=False, copy=kind == "copy")}
        try:
            engines["ngram"] = engine(model, args, spec=True, copy=kind == "copy")
            report["runners"][size][kind] = {name: runners(e) for name, e in engines.items()}
            report["startup_s"][size][kind] = round(time.monotonic() - t0, 1)
            batch, facts = prompts(kind, engines["plain"], max(args.batch_sizes), args, vocab)
            report["prompts"][size][kind] = facts | {"tokens": [len(p) for p in batch]}
            for bs in args.batch_sizes:
                r = compare(engines, kind, batch[:bs], args)
                print(json.dumps(r), flush=True)
                report["results"].append(r)
                if args.json:
                    args.json.write_text(json.dumps(report, indent=2) + "\n")
        finally:
            while engines:  # each shut down and dropped before the next workload's pair loads
                engines.popitem()[1].shutdown()
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", help="generated llama sizes, comma-separated (tiny, small, 1b, 8b)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="the engines' dtype (default: the model's)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: seeded random weights from config.json alone (8b has no weight file)")
    p.add_argument("--plain-overlap", action="store_true",
                   help="the plain engine with the overlap schedule, as served by default on a GPU (NGRAM runs "
                        "without it)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--cycle-search", type=int, default=0,
                   help="copy: greedy tokens generated to find the copy model's cycle (default: half --prompt-len)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--num-steps", type=int, default=None, help="--speculative-num-steps (default: the flag's)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--workloads", default="copy,free,sampled")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batches.split(",") if b]
    unknown = set(args.workloads.split(",")) - set(SAMPLING)
    if unknown:
        p.error(f"--workloads: unknown {sorted(unknown)}; choose from {', '.join(SAMPLING)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible (use --device cpu)")
    sizes = [s for s in args.size.split(",") if s]
    from common.model_gen.make_model import SIZES

    for size in sizes:
        if size not in SIZES:
            p.error(f"--size: unknown {size!r}; choose from {', '.join(SIZES)}")
        if not SIZES[size].weights and args.load_format != "dummy":
            p.error(f"--size {size} is generated without weights: pass --load-format dummy")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    report: dict[str, Any] = {
        "benchmark": "spec_decode", "date": time.strftime("%Y-%m-%d"), "commit": commit.strip(),
        "machine": f"{machine}, {os.cpu_count()} cores", "model": args.size, "device": args.device,
        "dtype": args.dtype, "load_format": args.load_format, "plain_overlap": args.plain_overlap,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "threads": args.threads, "results": [], "runners": {}, "startup_s": {}, "prompts": {}}
    failed = False
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        for size in sizes:
            try:
                run_size(size, args, Path(tmp), report)
            except Exception as e:  # recorded: the next size still runs
                report.setdefault("errors", {})[size] = f"{type(e).__name__}: {e}"[:2000]
                print(f"{size}: {report['errors'][size]}", flush=True)
                failed = True
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
