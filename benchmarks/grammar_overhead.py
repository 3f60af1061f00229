"""Grammar overhead per decode step: a constrained batch's step time as a ratio of the same batch unconstrained,
measured in the same run.

Two measurements, each alternating constrained / unconstrained per repeat (medians):

  sampling step   the grammar's own work in one step, on the same ``[bs, vocab]`` logits: ``from_reqs`` (fills one
                  bitmask row per request from its matcher) + the sampler (masks, then draws) + ``accept`` of each
                  drawn token, against ``from_reqs`` + the sampler on the same requests without grammars.
  engine decode   a whole ``Engine`` run of ``--num-prompts`` greedy requests of ``--output-len`` tokens, EOS ignored,
                  constrained by a regex that never completes (so both runs produce the same number of tokens),
                  against the same requests free; per output token. This includes the forward and the loss of the
                  overlap schedule for constrained batches (their results are processed before the next batch).

    .venv/bin/python -m benchmarks.grammar_overhead                     # tiny model, bs 16, 64 tokens
    .venv/bin/python -m benchmarks.grammar_overhead --num-prompts 32 --json benchmarks/results/grammar_overhead.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Never completes (any number of lowercase words): the constrained run ends by length like the free one.
ENDLESS = r"[a-z ]+"


def sampling_step(model_path: str, bs: int, steps: int, repeats: int) -> dict[str, Any]:
    import torch

    from common.engine.req import Req
    from common.engine.sampling.grammar import GrammarCompiler, tokenizer_info
    from common.engine.sampling.params import SamplingParams
    from common.engine.sampling.sampler import Sampler, SamplingBatchInfo
    from common.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(tokenizer_info(tok, vocab, [tok.eos_token_id]), any_whitespace=False)
    key = ("regex", ENDLESS)
    compiler.submit(key).result(timeout=60)
    sp = SamplingParams(temperature=0.0, regex=ENDLESS)
    sampler = Sampler(seed=0)
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(bs, vocab, generator=g) for _ in range(steps)]

    def run(constrained: bool) -> float:
        reqs = [Req(f"r{i}", [1, 2, 3], sp) for i in range(bs)]
        if constrained:
            for r in reqs:
                r.grammar = compiler.matcher(key)
        t0 = time.perf_counter()
        for lg in logits:
            info = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
            ids = sampler(lg, info).next_token_ids.tolist()
            for r, t in zip(reqs, ids, strict=True):
                if r.grammar is not None:
                    assert r.grammar.accept(t)
                r.output_ids.append(t)
        return (time.perf_counter() - t0) / steps

    free, constrained = [], []
    for _ in range(repeats):
        free.append(run(False))
        constrained.append(run(True))
    compiler.close()
    f, c = statistics.median(free), statistics.median(constrained)
    return {"bs": bs, "vocab": vocab, "free_ms": f * 1e3, "constrained_ms": c * 1e3, "ratio": c / f,
            "grammar_ms_per_step": (c - f) * 1e3}


def engine_decode(model_path: str, bs: int, output_len: int, repeats: int, overlap: bool) -> dict[str, Any]:
    from common.node.engine import Engine

    flags = {"enable_overlap_schedule": True} if overlap else {"disable_overlap_schedule": True}
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(bs)]
    base = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=model_path, max_total_tokens=8192, max_running_requests=bs, **flags) as engine:
        engine.generate(input_ids=prompts, sampling_params={**base, "regex": ENDLESS})  # warm: compile, caches

        def run(sp: dict[str, Any]) -> float:
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=sp)
            assert all(len(o.output_ids) == output_len for o in outs)
            return (time.perf_counter() - t0) / (bs * output_len)

        free, constrained = [], []
        for _ in range(repeats):
            free.append(run(base))
            constrained.append(run({**base, "regex": ENDLESS}))
    f, c = statistics.median(free), statistics.median(constrained)
    return {"bs": bs, "output_len": output_len, "overlap": overlap, "free_ms_per_token": f * 1e3,
            "constrained_ms_per_token": c * 1e3, "ratio": c / f}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF folder (default: the tiny generated llama)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=50, help="sampling steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    model_path = ns.model_path
    if model_path is None:
        from tests.model_fixtures import make_tiny_model

        model_path = str(make_tiny_model("llama"))
    out = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "sampling_step": sampling_step(model_path, ns.num_prompts, ns.steps, ns.repeats),
        "engine_decode": [engine_decode(model_path, ns.num_prompts, ns.output_len, ns.repeats, o)
                          for o in (False, True)],
    }
    print(json.dumps(out, indent=2))
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
