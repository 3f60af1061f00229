"""Grammar compile cost under abuse, on one in-process Engine (tiny model): how long expensive grammars hold a rank's
compiles, what they leave in the rank's memory, and how long an ordinary grammar request waits behind them.

Cases (each on a fresh Engine, requests sent at once from threads):

  deep400   the 400-deep nested-object JSON schema of issue 54 (about 24 KB), --grammar-compile-timeout 30
  wide4     four distinct schemas of 900 optional string properties with patterns (about 50 KB each, each seconds
            to tens of seconds to compile), then ordinary small schemas 0.5 s and 6 s later (each new to the cache),
            --grammar-compile-timeout 2

Per request: seconds to its answer and the answer (ok / the error's first words); per case: the scheduler process's
RSS before and after (the Engine's scheduler runs in this process). ``--root`` runs another checkout's code (e.g. the
baseline commit extracted with ``git archive``) with this venv, for a before/after in one sitting.

    .venv/bin/python -m benchmarks.grammar_compile_bound --json benchmarks/results/grammar_compile_bound.json
    .venv/bin/python benchmarks/grammar_compile_bound.py --root /tmp/base --json /tmp/base.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any


def deep_schema(depth: int) -> str:
    s: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return json.dumps(s)


def wide_schema(n: int, tag: str) -> str:
    props = {f"{tag}{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 7 + 9}}}$"} for i in range(n)}
    return json.dumps({"type": "object", "properties": props})


def small_schema(tag: str) -> str:
    return json.dumps({"type": "object", "properties": {tag: {"enum": ["a", "b"]}}, "required": [tag]})


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def run_case(engine: Any, requests: list[tuple[float, str, str]]) -> list[dict[str, Any]]:
    """``requests``: (delay s, name, json_schema); each answered in its own thread."""
    out: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def one(delay: float, name: str, schema: str) -> None:
        time.sleep(delay)
        start = time.monotonic()
        try:
            engine.generate("x", sampling_params={"max_new_tokens": 16, "temperature": 0, "json_schema": schema},
                            timeout=300)
            answer = "ok"
        except Exception as e:  # the benchmark records every outcome
            answer = f"{type(e).__name__}: {str(e)[:90]}"
        out.append({"name": name, "sent_s": round(start - t0, 2), "answered_s": round(time.monotonic() - t0, 2),
                    "wait_s": round(time.monotonic() - start, 2), "answer": answer})

    threads = [threading.Thread(target=one, args=r) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return sorted(out, key=lambda r: r["answered_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="code to run")
    ap.add_argument("--model-path", default=None, help="default: the tiny generated llama")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sys.path.insert(0, args.root)
    from common.node.engine import Engine

    model = args.model_path
    if model is None:
        from tests.model_fixtures import make_tiny_model

        model = str(make_tiny_model("llama"))
    results: dict[str, Any] = {"benchmark": "grammar_compile_bound", "root": args.root, "machine": platform.node(),
                               "cases": {}}
    cases = {
        "deep400": (30.0, [(0.0, "deep400", deep_schema(400))]),
        "wide4": (2.0, [*((0.0, f"wide{k}", wide_schema(900, f"w{k}_")) for k in range(4)),
                        (0.5, "small@0.5s", small_schema("a")), (6.0, "small@6s", small_schema("b"))]),
    }
    for name, (timeout, reqs) in cases.items():
        engine = Engine(model_path=model, max_total_tokens=4096, grammar_compile_timeout=timeout)
        engine.generate("warm", sampling_params={"max_new_tokens": 2, "json_schema": small_schema("warm")})
        before = rss_mb()
        rows = run_case(engine, reqs)
        time.sleep(1.0)
        results["cases"][name] = {"timeout_s": timeout, "rss_before_mb": round(before), "rss_after_mb": round(rss_mb()),
                                  "requests": rows}
        print(json.dumps({name: results["cases"][name]}, indent=1), flush=True)
        engine.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
