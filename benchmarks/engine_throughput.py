"""Engine throughput: our colocated ``Engine`` versus Hugging Face ``generate`` on the same weights.

Workload (the issue's): the ``small`` generated Llama, ``--num-prompts`` random prompts of ``--input-len`` tokens,
``--output-len`` output tokens each, greedy, EOS ignored. HF runs the whole batch in one left-padded
``model.generate`` call (its KV cache, no EOS stop). Each side lives in its own worker process (so each reports
its own peak RSS) with the same ``torch.set_num_threads``; the parent alternates the two per repeat so load drift
on a shared machine hits both alike, and reports medians.

    .venv/bin/python -m benchmarks.engine_throughput                  # defaults: 64 x 128 -> 128, 3 repeats
    .venv/bin/python -m benchmarks.engine_throughput --repeats 5 --page-size 1 --json out.json
    .venv/bin/python -m benchmarks.engine_throughput --tp-size 2     # + a tp 1 engine; each TP rank 1 thread
    .venv/bin/python -m benchmarks.engine_throughput --enable-torch-compile --torch-compile-max-bs 8 \
        --num-prompts 8 --baseline-eager                               # + an eager engine (no compile, no graphs)
    python3 -m benchmarks.engine_throughput --device cuda --dtype bfloat16 --model-path <make-model --size 1b>

Per repeat and side:
  output tok/s   num_prompts * output_len / wall time of the full generate call (prefill included)
  prefill tok/s  num_prompts * input_len / wall time of the same prompts with max_new_tokens = 1
Each repeat uses fresh prompts (seeded by the repeat index, identical for both sides), so the prefix cache never
turns a later repeat's prefill into a cache hit.
  vs eager      (--baseline-eager) our engine with the compile/graph flags against the same engine with
                --disable-cuda-graph and no --enable-torch-compile, in the same run
  comm share    (--tp-size > 1) seconds TP rank 0 spent in the model's all-reduce/all-gather (waiting for the
                slower rank included) / wall time of the full generate call
  decode step   (full run - prefill run) / (output_len - 1), printed beside the weight-read floor: bytes of the
                weights in --dtype / the device's peak memory bandwidth (--peak-bandwidth-gbs, or looked up by
                GPU name). A decode step reads every weight once, so it cannot be faster than that.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.engine_sides import LocalSide, Side, machine_facts, random_prompts  # noqa: E402

# Peak HBM bandwidth (GB/s) by GPU name, from the vendors' data sheets (SXM parts).
PEAK_BANDWIDTH_GBS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}


def _peak_bandwidth_gbs(device: str) -> float | None:
    import torch

    if device != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BANDWIDTH_GBS.items() if key in name), None)


def _weight_bytes(model_path: str, dtype: str, load_format: str = "auto") -> int:
    """Bytes of every weight of the model folder once loaded in ``dtype`` (dummy: of the config's model)."""
    import torch
    from safetensors import safe_open

    if load_format == "dummy":
        from common.engine.model.config import ModelConfig
        from common.engine.model.llama import LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(ModelConfig.from_path(model_path, "dummy"), device="meta")
        return sum(p.numel() for p in model.parameters()) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    numel = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            numel += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())  # noqa: SIM118
    return numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF folder (default: generate a llama of --model-size, seed 0)")
    p.add_argument("--model-size", default="small", help="preset of the generated llama (tiny, small, 1b)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--skip-prefill", action="store_true", help="skip the max_new_tokens=1 prefill runs")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="both sides run here")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--tp-size", type=int, default=1,
                   help="> 1: our engine with this many TP ranks (--threads split over them), beside a tp 1 engine")
    p.add_argument("--compare-overlap", action="store_true",
                   help="ours with the overlap schedule forced on, beside a side with it off (the default on CPU "
                        "turns it off where the threads take every core)")
    p.add_argument("--enable-torch-compile", action="store_true", help="our engine: compiled decode steps")
    p.add_argument("--torch-compile-max-bs", type=int, default=32, help="our engine: largest compiled decode batch")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help="our engine: largest captured decode batch")
    p.add_argument("--disable-cuda-graph", action="store_true", help="our engine: no CUDA graphs on cuda")
    p.add_argument("--baseline-eager", action="store_true",
                   help="+ our engine without compile and CUDA graphs (the 'ours_eager' side)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: the generated folder holds no weights; ours loads --load-format dummy, HF builds the "
                        "same weights from the config (common/model_gen/hf_dummy.py)")
    p.add_argument("--skip-hf-dynamic", action="store_true",
                   help="no HF generate with its dynamic cache (needs --hf-static: outputs are compared with it)")
    p.add_argument("--hf-static", action="store_true",
                   help="+ HF generate with a static cache (transformers compiles its decode step: 'hf_static')")
    p.add_argument("--in-process", action="store_true",
                   help="every side in this process instead of one process each (the CPU dry run: process starts "
                        "would cost more than its workload; peak RSS is then shared)")
    p.add_argument("--warmup-full", action="store_true",
                   help="warm every side up with the full workload (compiles and captures every shape) before timing")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after timing, profile our engine over this many decode steps of the full batch")
    p.add_argument("--peak-bandwidth-gbs", type=float, default=None,
                   help="device peak memory bandwidth for the weight-read floor (default: looked up for H100/H200)")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "engine_throughput.json"))
    a = p.parse_args(argv)

    from transformers import AutoConfig

    tmp = None
    model_path = a.model_path
    if model_path is None:
        from common.model_gen.make_model import make_model

        tmp = tempfile.TemporaryDirectory(prefix="pdc-bench-")
        model_path = str(make_model("llama", a.model_size, Path(tmp.name), seed=0,
                                    weights=False if a.load_format == "dummy" else None))
    if a.skip_hf_dynamic and not a.hf_static:
        p.error("--skip-hf-dynamic needs --hf-static (the side outputs are compared with)")
    hf_cfg = AutoConfig.from_pretrained(model_path)
    weight_bytes = _weight_bytes(model_path, a.dtype, a.load_format)
    vocab = hf_cfg.vocab_size
    n, lin, lout = a.num_prompts, a.input_len, a.output_len
    # Room for every request at once, plus a partial page each; the prefix cache evicts older repeats' prompts.
    engine_args = {
        "page_size": a.page_size,
        "max_total_tokens": n * (lin + lout + a.page_size),
        "max_running_requests": max(n, 1),
        "chunked_prefill_size": max(a.page_size, -(-n * lin // a.page_size) * a.page_size),
        "max_prefill_tokens": max(16384, n * lin),
        "disable_radix_cache": a.disable_radix_cache,
        "torch_num_threads": a.threads,
        "decode_log_interval": 10**9,
        "device": a.device,
        "dtype": a.dtype,
        "enable_torch_compile": a.enable_torch_compile,
        "torch_compile_max_bs": a.torch_compile_max_bs,
        "cuda_graph_max_bs": a.cuda_graph_max_bs,
        "disable_cuda_graph": a.disable_cuda_graph,
        "load_format": a.load_format,
    }
    machine = machine_facts(a.threads)
    print(f"model {model_path} (hidden {hf_cfg.hidden_size}, layers {hf_cfg.num_hidden_layers}, vocab {vocab})")
    print(f"workload: {n} prompts x {lin} input tokens -> {lout} output tokens, greedy, {a.repeats} repeats")
    print(f"engine args: {engine_args}")
    print(f"machine: {machine}")

    ours_args = engine_args | ({"enable_overlap_schedule": True} if a.compare_overlap else {})
    make_side = LocalSide if a.in_process else Side
    sides = {"ours": make_side("ours", model_path, a.threads, ours_args)}
    if a.tp_size > 1:
        per_rank = max(1, a.threads // a.tp_size)
        sides = {"ours_tp": make_side("ours_tp", model_path, per_rank,
                                  engine_args | {"tp_size": a.tp_size, "torch_num_threads": per_rank}), **sides}
    if a.compare_overlap:
        sides["ours_normal"] = make_side("ours", model_path, a.threads, engine_args | {"disable_overlap_schedule": True})
    if a.baseline_eager:
        sides["ours_eager"] = make_side("ours_eager", model_path, a.threads,
                                    engine_args | {"enable_torch_compile": False, "disable_cuda_graph": True})
    if not a.skip_hf_dynamic:
        sides["hf"] = make_side("hf", model_path, a.threads, engine_args)
    if a.hf_static:
        sides["hf_static"] = make_side("hf_static", model_path, a.threads, engine_args)
    comm_s: list[float] = []
    tp_agree: list[float] = []
    eager_outs: list[tuple[list[list[int]], list[list[int]]]] = []
    try:
        warm = random_prompts(10**6, n if a.warmup_full else min(n, 8), lin, vocab, low=3)
        for s in sides.values():
            s.run(warm, lout if a.warmup_full else 4)
            if a.warmup_full and not a.skip_prefill:
                s.run(warm, 1)
        decode_s: dict[str, list[float]] = {k: [] for k in sides}
        prefill_s: dict[str, list[float]] = {k: [] for k in sides}
        agree: list[float] = []
        for rep in range(a.repeats):
            prompts = random_prompts(rep, n, lin, vocab, low=3)
            outs = {}
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for k in order:
                secs, outs[k] = sides[k].run(prompts, lout)
                if k == "ours_tp":
                    comm_s.append(sides[k].last_comm_s / secs)
                if any(len(o) != lout for o in outs[k]):
                    raise RuntimeError(f"{k} returned fewer than {lout} tokens for some prompt")
                decode_s[k].append(secs)
            ref = outs["hf"] if "hf" in outs else outs["hf_static"]
            agree.append(sum(x == y for x, y in zip(outs["ours"], ref, strict=True)) / n)
            if "ours_eager" in outs:
                eager_outs.append((outs["ours"], outs["ours_eager"]))
            if "ours_tp" in outs:
                tp_agree.append(sum(x == y for x, y in zip(outs["ours_tp"], outs["ours"], strict=True)) / n)
            if not a.skip_prefill:
                pre = random_prompts(1000 + rep, n, lin, vocab, low=3)
                for k in order:
                    prefill_s[k].append(sides[k].run(pre, 1)[0])
            line = "  ".join(f"{k} {n * lout / decode_s[k][-1]:7.0f} out tok/s" for k in sides)
            print(f"repeat {rep}: {line}  (identical outputs {agree[-1]:.0%}, load {os.getloadavg()[0]:.1f})")
        rss = {k: s.peak_rss_mib() for k, s in sides.items()}
        prof = sides["ours"].profile(random_prompts(2 * 10**6, n, lin, vocab, low=3), a.profile_steps) \
            if a.profile_steps > 0 else None
    finally:
        for s in sides.values():
            s.stop()
        if tmp is not None:
            tmp.cleanup()

    def summary(k: str) -> dict[str, Any]:
        med = statistics.median(decode_s[k])
        out: dict[str, Any] = {
            "output_tok_per_s": n * lout / med,
            "seconds_median": med,
            "seconds": decode_s[k],
            "peak_rss_mib": rss[k],
        }
        if prefill_s[k]:
            pm = statistics.median(prefill_s[k])
            out["prefill_tok_per_s"] = n * lin / pm
            out["prefill_seconds"] = prefill_s[k]
            if lout > 1:
                out["decode_step_ms"] = (med - pm) / (lout - 1) * 1e3
        return out

    result = {
        "workload": {"num_prompts": n, "input_len": lin, "output_len": lout, "repeats": a.repeats, "greedy": True},
        "engine_args": engine_args,
        "machine": machine | {"loadavg_end": os.getloadavg()[0]},
        "ours": summary("ours"),
        "identical_output_fraction": agree,
    }
    if "hf" in sides:
        result["hf"] = summary("hf")
        result["ratio"] = result["ours"]["output_tok_per_s"] / result["hf"]["output_tok_per_s"]
    if "hf_static" in sides:
        result["hf_static"] = summary("hf_static")
        result["ratio_vs_hf_static"] = result["ours"]["output_tok_per_s"] / result["hf_static"]["output_tok_per_s"]
    if prof is not None:
        result["ours_profile"] = prof
    if "ours_tp" in sides:
        result["ours_tp"] = summary("ours_tp") | {"tp_size": a.tp_size, "comm_share": comm_s,
                                                  "comm_share_median": statistics.median(comm_s),
                                                  "identical_to_tp1_fraction": tp_agree}
        result["tp_ratio_vs_tp1"] = result["ours_tp"]["output_tok_per_s"] / result["ours"]["output_tok_per_s"]
    if "ours_normal" in sides:
        result["ours_normal"] = summary("ours_normal")
        result["overlap_ratio"] = result["ours"]["output_tok_per_s"] / result["ours_normal"]["output_tok_per_s"]
    if "ours_eager" in sides:
        result["ours_eager"] = summary("ours_eager")
        result["ratio_vs_eager"] = result["ours"]["output_tok_per_s"] / result["ours_eager"]["output_tok_per_s"]
    peak = a.peak_bandwidth_gbs or _peak_bandwidth_gbs(a.device)
    result["weight_bytes"] = weight_bytes
    result["peak_bandwidth_gbs"] = peak
    result["weight_read_floor_ms"] = weight_bytes / (peak * 1e9) * 1e3 if peak else None
    rows = [("ours", result["ours"])] + ([("hf generate", result["hf"])] if "hf" in result else [])
    if "hf_static" in result:
        rows.append(("hf static", result["hf_static"]))
    if "ours_tp" in result:
        rows.insert(0, (f"ours tp {a.tp_size}", result["ours_tp"]))
    if "ours_normal" in result:
        rows.insert(1, ("ours normal", result["ours_normal"]))
    if "ours_eager" in result:
        rows.insert(2 if "ours_normal" in result else 1, ("ours eager", result["ours_eager"]))
    print(f"\n{'':<12} {'out tok/s':>10} {'prefill tok/s':>14} {'peak RSS MiB':>13}")
    for name, r in rows:
        pre = f"{r['prefill_tok_per_s']:14.0f}" if "prefill_tok_per_s" in r else f"{'-':>14}"
        print(f"{name:<12} {r['output_tok_per_s']:10.0f} {pre} {r['peak_rss_mib']:13.0f}")
    if "ratio" in result:
        print(f"ratio ours / hf (output tok/s): {result['ratio']:.2f}x  (target >= 1.5x)")
    if "ours_tp" in result:
        print(f"ratio ours tp {a.tp_size} / ours tp 1 (output tok/s): {result['tp_ratio_vs_tp1']:.2f}x; "
              f"TP collectives take {result['ours_tp']['comm_share_median']:.0%} of the tp {a.tp_size} run (median)")
    if "ours_normal" in result:
        print(f"ratio ours (overlap) / ours (--disable-overlap-schedule): {result['overlap_ratio']:.2f}x")
    floor = result["weight_read_floor_ms"]
    floor_s = (f"{floor:.3f} ms ({weight_bytes / 2**30:.2f} GiB of weights at {peak:.0f} GB/s)" if floor
               else "unknown (pass --peak-bandwidth-gbs)")
    if "ours_eager" in result:
        eager_agree = [sum(x == y for x, y in zip(o, e, strict=True)) / n for o, e in eager_outs]
        result["identical_to_eager_fraction"] = eager_agree
        print(f"ratio ours / ours eager (output tok/s): {result['ratio_vs_eager']:.2f}x; identical outputs "
              f"{min(eager_agree):.0%} (min over repeats)")
    if "hf_static" in result:
        print(f"ratio ours / hf static+compiled (output tok/s): {result['ratio_vs_hf_static']:.2f}x")
    if prof is not None:
        print(f"profile of our engine, batch {n}, {a.profile_steps} steps: "
              f"{prof['launches_per_step']:.0f} launches per step {prof['launches']}")
        print(prof["top_by_device_time"])
    for name, key in (("ours", "ours"), ("ours normal", "ours_normal"), ("ours eager", "ours_eager"),
                      ("hf generate", "hf"), ("hf static", "hf_static")):
        step = result.get(key, {}).get("decode_step_ms")
        if step is not None:
            print(f"decode step {name:<12} {step:8.3f} ms   weight-read floor {floor_s}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.json}")
    return result


if __name__ == "__main__":
    main()
