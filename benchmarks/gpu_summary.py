"""One page of Markdown from ``benchmarks/gpu_check.py``'s results: each step's status and figures, each target
marked met or missed; where a decode-step or prefill target is missed, the profiler's table of where the time goes;
where a KV request's time goes, phase by phase (the ``kvtrace`` step)."""

from __future__ import annotations

from typing import Any

DECODE_STEP_TARGET_MS = 1.0  # 1B bf16, batch 64, 128 + 128 tokens (issue 50)
VS_HF_STATIC_TARGET = 2.0
SHM_VS_COPY_TARGET = 0.5  # one request; four in flight: SHM_INFLIGHT_TARGET
SHM_INFLIGHT_TARGET = 0.8
TCP_VS_RAW_TARGET = 0.8
PD_THROUGHPUT_TARGET = 0.95  # P/D over shm against colocated on one GPU
PD_TTFT_TARGET = 1.2
NGRAM_COPY_TARGET = 2.0  # NGRAM / plain tokens/s, batch 1, the copy workload, 8B (issue 51)
NGRAM_TARGET_SIZE = "8b"


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**MISSED**")


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _tests(r: dict[str, Any]) -> list[str]:
    d = r.get("data") or {}
    if "tests" not in d:
        return [f"- no junit report; last line: `{d.get('summary_line', '')}`"]
    lines = [f"- {d['passed']} passed, {d['failures']} failed, {d['errors']} errors, {d['skipped']} skipped "
             f"({_mark(d['failures'] + d['errors'] == 0)}: all pass)"]
    lines += [f"  - {p['kind']}: `{p['test']}`: {p['message'][:300]!r}" for p in d.get("problems", [])[:12]]
    return lines


def _engine(r: dict[str, Any]) -> list[str]:
    d = r.get("data")
    if not d:
        return []
    lines = ["| side | out tok/s | prefill tok/s | decode step ms |", "|---|---|---|---|"]
    for key in ("ours", "ours_eager", "hf", "hf_static"):
        s = d.get(key)
        if s:
            lines.append(f"| {key} | {_fmt(s.get('output_tok_per_s'), '.0f')} | "
                         f"{_fmt(s.get('prefill_tok_per_s'), '.0f')} | {_fmt(s.get('decode_step_ms'), '.3f')} |")
    step = d.get("ours", {}).get("decode_step_ms")
    ratio = d.get("ratio_vs_hf_static")
    floor = d.get("weight_read_floor_ms")
    lines.append("")
    lines.append(f"- decode step (CUDA graphs) {_fmt(step, '.3f')} ms, weight-read floor {_fmt(floor, '.3f')} ms: "
                 f"{_mark(None if step is None else step <= DECODE_STEP_TARGET_MS)} (<= {DECODE_STEP_TARGET_MS} ms)")
    lines.append(f"- ours / HF static+compiled {_fmt(ratio)}x: "
                 f"{_mark(None if ratio is None else ratio >= VS_HF_STATIC_TARGET)} (>= {VS_HF_STATIC_TARGET}x); "
                 f"ours / HF dynamic {_fmt(d.get('ratio'))}x; ours / eager {_fmt(d.get('ratio_vs_eager'))}x")
    agree = d.get("identical_output_fraction")
    if agree:
        lines.append(f"- greedy outputs identical to HF (this dtype): {min(agree):.0%} (min over repeats)")
    prof = d.get("ours_profile")
    if prof:
        lines.append(f"- profile, batch {prof['batch']}, {prof['steps']} steps: "
                     f"{prof['launches_per_step']:.0f} launches per step {prof['launches']}; device busy "
                     f"{_fmt(prof.get('device_ms_per_step'), '.3f')} ms of {_fmt(prof.get('wall_ms_per_step'), '.3f')}"
                     " ms wall per step (profiled)")
        if step is not None and step > DECODE_STEP_TARGET_MS:
            lines += ["", "Where the step's time goes (top ops by self device time):", "", "```",
                      prof["top_by_device_time"].rstrip(), "```"]
    return lines


KV_BASES = {"shm": (("device_copy", "memcpy"), SHM_VS_COPY_TARGET), "tcp": (("raw_tcp",), TCP_VS_RAW_TARGET)}


def _kv(r: dict[str, Any]) -> list[str]:
    d = r.get("data") or {}
    lines = []
    for mode, row in d.items():
        for backend, (bases, target) in KV_BASES.items():
            base = next((b for b in bases if b in row), None)
            got = row.get(backend)
            if base is None or got is None:
                continue
            if isinstance(got, str):
                lines.append(f"- {mode}: {backend} {got[:300]!r} **MISSED**")
                continue
            paired = row.get(f"{backend}/{base}")  # median of paired rounds, where there were several
            ratio = paired if isinstance(paired, int | float) else got / row[base]
            rounds = row.get(f"{backend}/{base} rounds")
            if backend == "shm" and " x" in mode:
                target = SHM_INFLIGHT_TARGET
            lines.append(f"- {mode}: {backend} / {base} = {ratio:.2f}x" + (f" (rounds {rounds})" if rounds else "")
                         + f": {_mark(ratio >= target)} (>= {target}x)")
        for key, v in row.items():
            if isinstance(v, str) and v.startswith("error") and key not in KV_BASES:
                lines.append(f"- {mode}: {key} {v[:300]!r}")
        gbs = {k: v for k, v in row.items() if isinstance(v, int | float) and "/" not in k and k != "tokens"}
        lines.append(f"- {mode} GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in gbs.items()))
    return lines


def _pd(r: dict[str, Any]) -> list[str]:
    d = r.get("data") or {}
    lines = ["| cluster | start-up s | KV pools | completed/failed | out req/s | TTFT p50 ms | identical | pools back |",
             "|---|---|---|---|---|---|---|---|"]
    for name, run in d.get("runs", {}).items():
        load = run.get("load", {})
        pools = ", ".join(f"{n} {f['kv_pool']['mib']:.0f} MiB on {f['kv_pool']['device']}"
                          for n, f in run.get("nodes", {}).items() if "kv_pool" in f)
        ident = run.get("identical_to_colocated")
        lines.append(f"| {name} | {_fmt(run.get('startup_s'), '.1f')} | {pools} | {load.get('completed', '-')}/"
                     f"{load.get('failed', '-')} | {_fmt(load.get('request_per_s'), '.1f')} | "
                     f"{_fmt(load.get('ttft_p50_ms'), '.0f')} | {'-' if ident is None else f'{ident:.0%}'} | "
                     f"{run.get('pools_back', '-')} |")
        if run.get("error"):
            lines.append(f"|  error: {run['error'][:300]!r} |||||||")
        for err in load.get("errors", []):
            lines.append(f"|  request error: {err[:200]!r} |||||||")
    colo = d.get("runs", {}).get("colocated", {}).get("load", {})
    for name, run in d.get("runs", {}).items():
        load = run.get("load", {})
        if name == "colocated" or not colo.get("request_per_s") or not load.get("request_per_s"):
            continue
        tput = load.get("output_tok_per_s", load["request_per_s"]) / colo.get("output_tok_per_s", colo["request_per_s"])
        ttft = (load.get("ttft_p50_ms") or 0) / colo["ttft_p50_ms"] if colo.get("ttft_p50_ms") else None
        check = name == "pd_shm"
        lines.append(f"- {name} / colocated: throughput {tput:.2f}x"
                     + (f" ({_mark(tput >= PD_THROUGHPUT_TARGET)}: >= {PD_THROUGHPUT_TARGET}x)" if check else "")
                     + f", TTFT p50 {_fmt(ttft)}x"
                     + (f" ({_mark(None if ttft is None else ttft <= PD_TTFT_TARGET)}: <= {PD_TTFT_TARGET}x)"
                        if check else ""))
    return lines


def _scale(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for size, d in ((r.get("data") or {}).get("sizes") or {}).items():
        if "error" in d:
            lines += [f"- {size}: error {d['error'][:600]!r}"]
            continue
        m = d["model"]
        lines += [f"### {size}: {m['params'] / 1e9:.2f} B params, {m['weight_bytes'] / 2**30:.1f} GiB {d['dtype']}; "
                  f"copy bandwidth {d['copy_bandwidth_gbs']:.0f} GB/s; CUDA graphs {'on' if d['cuda_graphs'] else 'off'}"
                  f"; start-up {d['startup_s']} s", "",
                  "| batch | context | step ms | floor ms | ratio | target |", "|---|---|---|---|---|---|"]
        lines += [f"| {p['batch']} | {p['context']} | {p['step_ms']:.3f} | {p['floor_ms']:.3f} | {p['ratio']:.2f}x | "
                  f"<= {p['target']}x: {_mark(p['met'])} |" for p in d["decode"]]
        lines += [f"| {p['batch']} | {p['context']} | skipped: {p['reason']} ||||" for p in d.get("skipped", [])]
        if d.get("verify"):
            lines += ["", f"Speculative verify step (CUDA graphs {'on' if d.get('verify_cuda_graphs') else 'off'}) "
                      "against the plain decode step:", "", "| batch | context | rows | verify ms | decode ms | ratio |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {p['batch']} | {p['context']} | {p['rows']} | {p['verify_ms']:.3f} | {p['decode_ms']:.3f} | "
                      f"{p['verify_over_decode']:.2f}x |" for p in d["verify"]]
        lines += ["", "| prefill tokens | tok/s | TFLOP/s | MFU | target |", "|---|---|---|---|---|"]
        lines += [f"| {p['tokens']} | {p['tok_per_s']:.0f} | {p['tflops']:.1f} | {_fmt(p['mfu'], '.0%')} | "
                  + (f">= {p['target_mfu']:.0%}: {_mark(p['met'])}" if p.get("target_mfu") else "-") + " |"
                  for p in d["prefill"]]
        for p in [*d["decode"], *d["prefill"]]:
            if p.get("profile"):
                what = (f"decode batch {p['batch']} context {p['context']}" if "batch" in p
                        else f"prefill {p['tokens']} tokens")
                lines += ["", f"Where the {what} goes (top ops by self device time):", "", "```",
                          p["profile"].rstrip(), "```"]
        lines.append("")
    return lines


def _host(r: dict[str, Any]) -> list[str]:
    d = r.get("data")
    if not d:
        return []
    last = d["last_repeat"]
    lines = [f"{_fmt(d['wall_ms_per_output_token_median'], '.3f')} ms wall per output token at batch {d['batch']} "
             f"(overlap {'on' if d['overlap'] else 'off'}); thread CPU per scheduler step "
             f"({last['scheduler_steps']} steps):", "", "| function | CPU ms / step | calls / step |", "|---|---|---|"]
    lines += [f"| {k} | {_fmt(v['cpu_ms_per_step'], '.3f')} | {_fmt(v['calls_per_step'])} |"
              for k, v in last["functions"].items()]
    return lines


def _kvtrace(r: dict[str, Any]) -> list[str]:
    d = r.get("data")
    if not d:
        return []
    lines = [f"Where one {d['backend']} request's time goes ({d['requests']} requests one at a time, traced; ms after "
             "`send()` began, median [min .. max]):", "", "| event | median ms | range ms |", "|---|---|---|"]
    lines += [f"| `{p['event']}` | {p['median_ms']:.3f} | {p['min_ms']:.3f} .. {p['max_ms']:.3f} |" for p in d["phases"]]
    return lines


def _spec(r: dict[str, Any]) -> list[str]:
    d = r.get("data") or {}
    lines = [f"- {size}: error {err[:600]!r}" for size, err in (d.get("errors") or {}).items()]
    rows = d.get("results") or []
    if not rows:
        return lines
    lines += [f"NGRAM against plain decoding ({d.get('dtype') or 'model dtype'}, {d.get('load_format')} weights, "
              f"prompts ~{d.get('prompt_len')} + cycle, {d.get('new_tokens')} new tokens, median of "
              f"{d.get('repeats')}; plain side overlap {'on' if d.get('plain_overlap') else 'off'}):", "",
              "| size | workload | batch | plain tok/s | NGRAM tok/s | ratio | ITL ratio | accept length | drafted "
              "| greedy identical | target |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        target = "-"
        if x["workload"] == "copy" and x["batch"] == 1:
            ok = x["speedup_tokens_per_s"] >= NGRAM_COPY_TARGET if x["size"] == NGRAM_TARGET_SIZE else None
            target = f">= {NGRAM_COPY_TARGET}x at {NGRAM_TARGET_SIZE}: {_mark(ok)}"
        lines.append(f"| {x['size']} | {x['workload']} | {x['batch']} | {x['plain']['tokens_per_s']:.1f} | "
                     f"{x['ngram']['tokens_per_s']:.1f} | {x['speedup_tokens_per_s']:.2f}x | {x['itl_ratio']:.2f} | "
                     f"{x['ngram']['accept_length']:.2f} | {x['ngram']['drafted_share']:.2f} | "
                     f"{x['identical_token_share']:.0%} | {target} |")
    lines.append("")
    for size, kinds in (d.get("runners") or {}).items():
        for kind, sides in kinds.items():
            served = "; ".join(f"{side}: " + ", ".join(f"{step} {how}" for step, how in steps.items())
                               for side, steps in sides.items())
            eager = d.get("device") == "cuda" and any(how != "cuda_graph" for steps in sides.values()
                                                      for how in steps.values())
            lines.append(f"- {size} {kind} step runners: {served}" + (" (**not all CUDA graphs**: a runner failed "
                                                                      "its start-up check, see spec.log)" if eager else ""))
    for size, kinds in (d.get("prompts") or {}).items():
        for kind, facts in kinds.items():
            if "prompts_in_cycle" in facts:
                lines.append(f"- {size} {kind} prompts: {facts['prompts_in_cycle']:.0%} hold the copy model's cycle "
                             f"(lengths {facts['cycle_lengths']}), {min(facts['tokens'])}..{max(facts['tokens'])} tokens")
    return lines


SECTIONS = {"tests": _tests, "engine": _engine, "host": _host, "kv": _kv, "kvsig": _kv, "pd": _pd, "kvtrace": _kvtrace,
            "compile": _engine, "scale": _scale,
            "spec": _spec}


def summarize(result: dict[str, Any]) -> str:
    env = result["env"]
    gpu = env.get("gpu") or "no GPU"
    out = [f"# GPU check {'(dry run on CPU) ' if result['dry_run'] else ''}{result['started']}", "",
           f"{gpu} ({env.get('nvidia_smi', '')}); torch {env['torch']} (CUDA {env.get('torch_cuda')}), Python "
           f"{env['python']}, {env['host_cores']} cores; commit {result.get('commit') or 'unknown'}; "
           f"{result.get('seconds', '-')} s of a {result['budget_s']:.0f} s budget", "",
           "Modules: " + ", ".join(f"{k} {v or 'absent'}" for k, v in env["modules"].items()), ""]
    for name, r in result["steps"].items():
        out.append(f"## {name}: {r['status']}" + (f" ({r['seconds']} s)" if "seconds" in r else ""))
        out.append("")
        if r["status"] in ("failed", "timeout") and not r.get("data"):
            out += ["```", r.get("log_tail", "")[-1500:].rstrip(), "```"]
        out += SECTIONS[name](r)
        out.append("")
    return "\n".join(out) + "\n"
