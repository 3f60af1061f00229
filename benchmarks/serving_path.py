"""The serving path's cost (issue 33): one workload served offline (the ``Engine`` directly), online through one
colocated node, and online P/D, with the CPU seconds every process of the cluster spent per 1,000 output tokens.

    .venv/bin/python -m benchmarks.serving_path --json benchmarks/results/serving_path.json
    .venv/bin/python -m benchmarks.serving_path --repeats 3 --configs offline,colocated,pd,colocated_tuned
    .venv/bin/python -m benchmarks.serving_path --py-spy            # + a profile of each run's busiest process

Workload: the generated ``small`` Llama (seed 0), ``--num-requests`` prompts of ``--input-len`` random token ids,
``--output-len`` tokens each (``ignore_eos``, greedy), fresh prompts per repeat, the same for every configuration.

  offline          the ``Engine`` in a worker process (``benchmarks.engine_throughput``'s), ``--offline-threads``
                   torch threads, the prompts in batches of ``--concurrency``; its wall time is the sum of the
                   ``generate`` calls
  colocated        ``pdcluster up --colocated 1`` (defaults: on CPU every core to its one rank)
  pd               ``pdcluster up`` defaults: router + 1 prefill + 1 decode node
  colocated_tuned  ``up --colocated 1 --torch-num-threads <cores>`` (not run unless named)
  colocated_1thread  ``up --colocated 1 --torch-num-threads 1`` (up's CPU default before 7a6f42e; not run unless named)

Online runs are a closed loop of ``--concurrency`` streamed ``/v1/completions`` through the router's OpenAI API
(the ``pdcluster bench`` client), after a warm-up of ``--concurrency`` short requests. Around the timed window the
benchmark reads the CPU seconds of every process of the cluster (``up``, router, its tokenizer workers, node fronts,
scheduler ranks; ``benchmarks/proc_cpu.py``) and of its own load generator. Reported per configuration: out tok/s,
TTFT/ITL p50/p99, CPU seconds per 1,000 output tokens per process and in all, cores busy (CPU s / wall s), and the
issue's ratios: colocated / offline out tok/s, P/D / colocated out tok/s and TTFT p50, and the router + fronts
(+ the router's tokenizer workers) share of the cluster's CPU seconds. With ``--repeats`` > 1 every figure is the
median over repeats, and the configurations run in an alternating order.

``--py-spy``: after each online timed window, a second window of the same load (not in the figures) while py-spy
samples that run's busiest process for ``--py-spy-seconds``; the collapsed stacks go next to the JSON and the busiest
frames into it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.engine_sides import Side
from benchmarks.loadgen.runner import LoadShape, run_load
from benchmarks.loadgen.stats import summarize
from benchmarks.loadgen.workload import WorkloadConfig, make_workload
from benchmarks.proc_cpu import (
    CpuWindow,
    Proc,
    by_category,
    cluster_processes,
    py_spy_record,
    summarize_collapsed,
)
from benchmarks.up_runs import UpCluster, client_for, free_port, machine_info

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("offline", "colocated", "pd", "colocated_tuned", "colocated_1thread")
FRONT_SIDE = ("router", "tokenizer", "front")  # the serving path outside the ranks


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="offline,colocated,pd", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--model-path", default=None, help="default: generate the small llama (seed 0)")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32, help="online: requests in flight; offline: batch size")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--offline-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-total-tokens", type=int, default=32768, help="KV tokens per rank, every configuration")
    ap.add_argument("--up-flag", action="append", default=[], help="one more flag for every `up` (repeatable)")
    ap.add_argument("--ready-timeout", type=float, default=240.0)
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds; no request starts after it")
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--py-spy", action="store_true", help="profile each online run's busiest process")
    ap.add_argument("--py-spy-seconds", type=int, default=8)
    ap.add_argument("--py-spy-process", default=None,
                    help="profile this process (its label: router, decode-0, null-0/rank0, ...) instead of the busiest")
    ap.add_argument("--json", default=None, help="write the report here")
    a = ap.parse_args(argv)
    a.configs = a.configs.split(",")
    if unknown := set(a.configs) - set(CONFIGS):
        ap.error(f"unknown configs {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    if a.repeats < 1 or a.num_requests < 1 or a.concurrency < 1:
        ap.error("--repeats, --num-requests and --concurrency must be >= 1")
    a.api = "openai"
    if a.py_spy:
        a.py_spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(a.py_spy_bin).is_file():
            ap.error("--py-spy: no py-spy on PATH or beside this python (pip install py-spy)")
    return a


def _up_args(a: argparse.Namespace, config: str) -> list[str]:
    topo = {"pd": ["--prefill", "1", "--decode", "1"],
            "colocated_tuned": ["--torch-num-threads", str(os.cpu_count() or 1)],
            "colocated_1thread": ["--torch-num-threads", "1"]}.get(config, [])  # up's default before 7a6f42e
    if config.startswith("colocated"):
        topo = ["--prefill", "0", "--decode", "0", "--colocated", "1", *topo]
    return ["--model-path", a.model_path, *topo, "--max-total-tokens", str(a.max_total_tokens), *a.up_flag]


def _per_1k(window: dict[str, Any], out_tokens: int) -> dict[str, Any]:
    """The window's CPU seconds per 1,000 output tokens: per process, per category, in all; and cores busy."""
    k = 1000.0 / max(out_tokens, 1)
    cats = by_category(window)
    total = sum(v for c, v in cats.items() if c != "client")
    return {"per_process": {r["label"]: None if r["cpu_s"] is None else round(r["cpu_s"] * k, 3)
                            for r in window["processes"]},
            "per_category": {c: round(v * k, 3) for c, v in cats.items()},
            "cluster": round(total * k, 3),
            "front_side_share": round(sum(cats.get(c, 0.0) for c in FRONT_SIDE) / total, 4) if total else None,
            "cores_busy": round(total / window["wall_s"], 3) if window["wall_s"] else None}


async def _online_window(a: argparse.Namespace, cluster: UpCluster, procs: list[Proc], wl: WorkloadConfig,
                         profile_to: Path | None) -> dict[str, Any]:
    client = client_for(a, cluster)
    me = Proc(os.getpid(), "client", "client")
    try:
        await asyncio.wait_for(client.resolve_model(), 30)  # type: ignore[attr-defined]
        warm = WorkloadConfig(kind="fixed", num_requests=a.concurrency, input_len=a.input_len, output_len=8,
                              token_id_range=wl.token_id_range, seed=10**6 + wl.seed)
        shape = LoadShape(concurrency=a.concurrency, time_limit_s=a.time_limit, grace_s=a.grace, progress=False)
        await run_load(client, make_workload(warm), replace(shape, time_limit_s=60))
        cpu = CpuWindow([*procs, me])
        cpu.start()
        run = await run_load(client, make_workload(wl), shape)
        window = cpu.stop()
        summary = summarize(run.results, run.wall_s)
        out_tokens = sum(r.output_tokens for r in run.results if r.ok)
        out: dict[str, Any] = {"summary": summary, "out_tokens": out_tokens, "window": window}
        if profile_to is not None:
            candidates = [r for r in window["processes"] if r["category"] != "client" and r["cpu_s"]
                          and a.py_spy_process in (None, r["label"])]
            if not candidates:
                labels = sorted(r["label"] for r in window["processes"])
                raise SystemExit(f"--py-spy-process {a.py_spy_process!r}: no busy process of that label here; "
                                 f"the labels are {labels}")
            hottest = max(candidates, key=lambda r: r["cpu_s"])
            spy = py_spy_record(a.py_spy_bin, hottest["pid"], a.py_spy_seconds, profile_to)
            await run_load(client, make_workload(replace(wl, seed=wl.seed + 10**5)), shape)
            try:
                _, err = await asyncio.to_thread(spy.communicate, timeout=a.py_spy_seconds + 30)
            except subprocess.TimeoutExpired:
                spy.kill()
                _, err = spy.communicate(timeout=10)
            out["py_spy"] = {"process": hottest["label"], "file": str(profile_to), "exit_code": spy.returncode}
            if profile_to.is_file():
                out["py_spy"] |= summarize_collapsed(profile_to)
            else:
                out["py_spy"]["error"] = err.decode(errors="replace")[-1000:]
        return out
    finally:
        await client.close()


def _run_online(a: argparse.Namespace, config: str, wl: WorkloadConfig, log: Path,
                profile_to: Path | None) -> dict[str, Any]:
    cluster = UpCluster(_up_args(a, config), log, free_port(), free_port())
    cluster.start()
    try:
        cluster.wait_ready(a.ready_timeout)
        assert cluster.proc is not None and cluster.children is not None
        procs = cluster_processes(cluster.proc.pid, cluster.children)
        return asyncio.run(_online_window(a, cluster, procs, wl, profile_to))
    except BaseException:
        print(f"{config} failed; up's log:\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr, flush=True)
        raise
    finally:
        cluster.stop()


def _key(run: dict[str, Any]) -> dict[str, Any]:
    s, cpu = run["summary"], run["cpu_per_1k"]
    return {"output_tok_per_s": s["output_token_throughput"], "ttft_p50_ms": s["ttft"].get("p50_ms"),
            "ttft_p99_ms": s["ttft"].get("p99_ms"), "itl_p50_ms": s["itl"].get("p50_ms"),
            "itl_p99_ms": s["itl"].get("p99_ms"), "completed": s["completed"], "failed": s["failed"],
            "cluster_cpu_s_per_1k": cpu["cluster"], "cores_busy": cpu["cores_busy"],
            "front_side_share": cpu["front_side_share"],
            "client_cpu_s_per_1k": cpu["per_category"].get("client")}


def _median(xs: list[Any]) -> Any:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def _ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 3) if x and y else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = _parse(argv)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdc-serving-path-") as tmp_name:
        tmp = Path(tmp_name)
        if a.model_path is None:
            from common.model_gen.make_model import make_model

            a.model_path = str(make_model("llama", "small", tmp / "model", seed=0))
        info = machine_info() | {"loadavg_start": os.getloadavg()}
        print(f"machine {info}", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in a.configs}
        offline = None
        try:
            if "offline" in a.configs:
                offline = Side("ours", a.model_path, a.offline_threads,
                                {"torch_num_threads": a.offline_threads, "max_total_tokens": a.max_total_tokens,
                                 "decode_log_interval": 10**9})
                offline.run([[100 + i] * a.input_len for i in range(a.concurrency)], 8)  # warm-up
            for rep in range(a.repeats):
                wl = WorkloadConfig(kind="fixed", num_requests=a.num_requests, input_len=a.input_len,
                                    output_len=a.output_len, token_id_range=(100, 8000), seed=rep)
                order = a.configs if rep % 2 == 0 else a.configs[::-1]
                for config in order:
                    load0 = os.getloadavg()[0]
                    if config == "offline":
                        assert offline is not None
                        run = _run_offline(a, offline, wl)
                    else:
                        spy = (Path(a.json).with_name(f"{Path(a.json).stem}_pyspy_{config}_r{rep}.txt")
                               if a.json else tmp / f"pyspy_{config}_r{rep}.txt") if a.py_spy else None
                        run = _run_online(a, config, wl, tmp / f"{config}-r{rep}.log", spy)
                    run["cpu_per_1k"] = _per_1k(run["window"], run["out_tokens"])
                    run |= {"repeat": rep, "loadavg_before": round(load0, 2),
                            "loadavg_after": round(os.getloadavg()[0], 2)}
                    runs[config].append(run)
                    print(f"repeat {rep} {config}: {json.dumps(_key(run))}", flush=True)
                    if a.json:  # what ran so far survives a kill; the full report replaces it
                        Path(a.json).write_text(json.dumps({"partial": True, "machine": info, "runs": runs}) + "\n")
        finally:
            if offline is not None:
                offline.stop()
    return _report(a, info, runs)


def _run_offline(a: argparse.Namespace, side: Side, wl: WorkloadConfig) -> dict[str, Any]:
    prompts = [s.prompt_ids for s in make_workload(wl)]
    cpu = CpuWindow([Proc(side.proc.pid, "engine", "engine")])
    cpu.start()
    seconds = 0.0
    for i in range(0, len(prompts), a.concurrency):
        secs, outs = side.run(prompts[i:i + a.concurrency], a.output_len)
        if any(len(o) != a.output_len for o in outs):
            raise RuntimeError(f"offline engine returned fewer than {a.output_len} tokens for some prompt")
        seconds += secs
    window = cpu.stop()
    out_tokens = len(prompts) * a.output_len
    summary = {"output_token_throughput": round(out_tokens / seconds, 2), "ttft": {}, "itl": {},
               "completed": len(prompts), "failed": 0, "wall_s": round(seconds, 3)}
    return {"summary": summary, "out_tokens": out_tokens, "window": window}


def _report(a: argparse.Namespace, info: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    keys = {c: {m: _median([_key(r)[m] for r in rs]) for m in _key(rs[0])} for c, rs in runs.items()}
    labels = sorted({lbl for rs in runs.values() for r in rs for lbl in r["cpu_per_1k"]["per_process"]})
    per_proc = {c: {lbl: _median([r["cpu_per_1k"]["per_process"].get(lbl) for r in rs]) for lbl in labels}
                for c, rs in runs.items()}
    k = {c: keys.get(c, {}) for c in CONFIGS}
    ratios = {"colocated_vs_offline_tok_s": _ratio(k["colocated"].get("output_tok_per_s"),
                                                  k["offline"].get("output_tok_per_s")),
              "pd_vs_colocated_tok_s": _ratio(k["pd"].get("output_tok_per_s"), k["colocated"].get("output_tok_per_s")),
              "pd_vs_colocated_ttft_p50": _ratio(k["pd"].get("ttft_p50_ms"), k["colocated"].get("ttft_p50_ms")),
              "colocated_tuned_vs_offline_tok_s": _ratio(k["colocated_tuned"].get("output_tok_per_s"),
                                                        k["offline"].get("output_tok_per_s"))}
    report = {"benchmark": "serving_path", "config": {x: y for x, y in vars(a).items() if x != "py_spy_bin"},
              "machine": info | {"loadavg_end": os.getloadavg()}, "medians": keys,
              "cpu_s_per_1k_by_process": per_proc, "ratios": ratios, "runs": runs}
    cols = ("output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "cluster_cpu_s_per_1k",
            "cores_busy", "front_side_share", "client_cpu_s_per_1k", "completed", "failed")
    print("\n| config | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 1) + "|")
    for c, m in keys.items():
        print(f"| {c} | " + " | ".join(str(m[x]) for x in cols) + " |")
    print("\nCPU seconds per 1,000 output tokens, per process\n\n| process | " + " | ".join(runs) + " |\n"
          + "|---" * (len(runs) + 1) + "|")
    for lbl in labels:
        print(f"| {lbl} | " + " | ".join(str(per_proc[c][lbl] if per_proc[c][lbl] is not None else "")
                                          for c in runs) + " |")
    print("\nratios: " + ", ".join(f"{x} {y}" for x, y in ratios.items() if y is not None))
    for c, rs in runs.items():
        for r in rs:
            if "py_spy" in r:
                p = r["py_spy"]
                print(f"\npy-spy {c} r{r['repeat']}: {p['process']} ({p.get('samples', 0)} samples, {p['file']})")
                for frame, n in p.get("top_self", [])[:10]:
                    print(f"  {n:6d}  {frame}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {a.json}")
    return report


if __name__ == "__main__":
    main()
