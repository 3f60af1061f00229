"""The GPU check: the whole accelerator path in one command, within a time budget, every result under ``--out``.

    make gpu-check                                        # on a GPU machine (no .venv there: installs .whl/ first)
    python3 -m benchmarks.gpu_check --out $OUT            # the same, by hand
    python -m benchmarks.gpu_check --dry-run --out /tmp/x # the same plumbing on CPU, tiny sizes (in make test)

Steps, in order of value; each runs in a child process with its own deadline (cut to what is left of
``--budget-s``), and a failed step is recorded while the next one still runs. By default (issues 50 and 51's check,
sized to fit the budget on an H200) scale, pd, kv, kvsig, engine, spec, tests; host, kvtrace and compile on request
(``--steps``):

    env     GPU, driver, torch/triton/transformers versions, which optional packages load
    scale   benchmarks/model_scale.py: 8B- and 1B-shaped llamas (bf16, --load-format dummy): the decode step at
            batch 1/8/64/256 x context 1k/8k, each against its floor (weights + KV read / the card's copy
            bandwidth), prefill of a 4k and a 16k prompt (tokens/s, MFU); a profiler table per missed target
    pd      benchmarks/gpu_pd.py: pdcluster up 1 prefill + 1 decode over shm and over tcp, then colocated, on the one
            GPU, 8B dummy weights, a mixed load (prompts 512..4k, outputs 128..512, 64 at once) through the OpenAI
            API; throughput and TTFT against colocated; texts identical to colocated; pools back; start-up seconds
    kv      benchmarks/kv_transfer.py --device cuda: a 512 MiB paged request, alone and 4 in flight, over shm
            (CUDA IPC) against an in-process device copy; nixl (VRAM) too where its wheel loads
    kvsig   the kv step with shm's landing signals (--option landing_signal=auto: CUDA IPC events), against kv's
            default (off)
    engine  benchmarks/engine_throughput.py: colocated engine, 1B-shaped llama bf16 (dummy weights), 64 x 128 ->
            128 greedy, with CUDA graphs, against HF generate with a static cache, compiled (hf_static, the same
            weights), both warmed up with the full workload; decode step ms beside the card's weight-read floor;
            a torch profiler table of our decode steps
    spec    benchmarks/spec_decode.py: NGRAM against plain decoding, 8B-shaped llama bf16 (dummy weights, attention
            outputs zeroed: the copy workload), batch 1 and 8, CUDA graphs; tokens/s ratio (issue 51: >= 2x at
            batch 1), accept length, which step runners served (graphs or fallen back to eager)
    tests   pytest tests/gpu (engine vs transformers, Triton kernels, CUDA graphs, GPU KV transfers, PD on one GPU)
    host    benchmarks/host_step.py: the engine step's decode at batch 64, each scheduler/forward function's thread
            CPU time per step (where the host time of a host-bound step goes)
    kvtrace benchmarks/kvtrace/phases.py --run: one 512 MiB shm request at a time with the control path traced;
            where a request's time goes, phase by phase, across both processes (the shm target's lever)
    compile (GPU only) the engine step's workload with our decode steps compiled inside the CUDA graphs
            (--enable-torch-compile) against HF static+compiled

The dry run (``--dry-run``, in ``make test``) runs every step but compile on CPU at tiny sizes.

Writes ``<step>.log`` and ``<step>.json`` per step, ``summary.json`` (everything) and ``summary.md`` (one page,
targets marked) under ``--out``, and prints progress as it goes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import resource
import shlex
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.forked_steps import ForkedProcess, in_child, preload  # noqa: E402
from benchmarks.gpu_summary import summarize  # noqa: E402

OPTIONAL_MODULES = ("msgspec", "zmq", "grpc", "triton", "transformers", "nixl", "ucxx", "mooncake.engine", "ray")
KILL_GRACE_S = 10.0


@dataclass
class Step:
    name: str
    argv: list[str]  # after ``python -m``
    timeout_s: float
    result: dict[str, Any] = field(default_factory=dict)


PER_TEST_TIMEOUT_S = 90


def _per_test_timeout() -> list[str]:
    """A hung test fails on its own (pytest-timeout, where installed: the GPU machines have it) instead of taking the
    whole step's deadline and, with it, the report of every test before it."""
    try:
        importlib.import_module("pytest_timeout")
    except ImportError:
        return []
    return [f"--timeout={PER_TEST_TIMEOUT_S}"]


def _parallel_tests() -> list[str]:
    """4 xdist workers, whole files each, where pytest-xdist is installed (the GPU machines have it): one at a time
    tests/gpu takes several times as long (benchmarks/pages/gpu_check.md)."""
    try:
        importlib.import_module("xdist")
    except ImportError:
        return []
    return ["-n", "4", "--dist", "loadfile"]


STEPS = ("scale", "pd", "kv", "kvsig", "engine", "spec", "tests", "host", "kvtrace", "compile")
DEFAULT_STEPS = "scale,pd,kv,kvsig,engine,spec,tests"  # --budget-s on an H200: benchmarks/pages/gpu_check.md
DRY_RUN_STEPS = "scale,pd,kv,engine,spec,tests,host,kvtrace"  # every step's code path (compile: GPU only)


def steps_for(a: argparse.Namespace, out: Path) -> list[Step]:
    py = ["-m"]
    junit = str(out / "tests.xml")
    parallel = [] if a.dry_run else _parallel_tests()
    tests = Step("tests", [*py, "pytest", "-v", "-p", "no:cacheprovider", "-rA", "--durations=15", "tests/gpu",
                           "--junitxml", junit, "--deselect", "tests/gpu/test_benchmark_cuda.py",
                           *_per_test_timeout(), *parallel, *shlex.split(a.pytest_args)], 150)
    if a.dry_run:  # the same code paths on CPU at tiny sizes, each step as lean as its path allows
        scale_sizes = ["--device", "cpu", "--dtype", "float32", "--model-size", "tiny", "--batches", "1,4",
                       "--contexts", "32,96", "--prefill", "64", "--steps", "2", "--profile-misses", "1"]
        engine_sizes = ["--device", "cpu", "--dtype", "float32", "--model-size", "tiny", "--num-prompts", "4",
                        "--input-len", "16", "--output-len", "8", "--repeats", "1", "--threads", "1",
                        "--profile-steps", "4", "--in-process"]
        host_sizes = ["--device", "cpu", "--null-forward", "--batch", "8", "--input-len", "16", "--output-len", "8",
                      "--repeats", "1"]
        kv_sizes = ["--device", "cpu", "--backends", "shm", "--tokens", "64", "--reps", "1", "--rounds", "1",
                    "--inflight", "2"]
        # The tiny llama and a 4096-token KV pool per node (the CPU default sizes the pool from free RAM: GiBs to
        # allocate and zero per node, for a few short requests).
        pd_sizes = ["--device", "cpu", "--dtype", "float32", "--backends", "tcp", "--model-size", "tiny",
                    "--num-requests", "6", "--input-len", "16", "--input-len-max", "48", "--output-len", "4",
                    "--output-len-max", "8", "--concurrency", "3", "--node-flag=--max-total-tokens=4096"]
        trace_sizes = ["--device", "cpu", "--tokens", "64", "--reps", "4"]
        spec_sizes = ["--device", "cpu", "--dtype", "float32", "--size", "tiny", "--batches", "1,2", "--repeats", "1",
                      "--prompt-len", "64", "--cycle-search", "160", "--new-tokens", "16", "--threads", "1"]
    else:
        scale_sizes = ["--device", "cuda", "--dtype", "bfloat16", "--model-size", "8b", "--model-size", "1b"]
        engine_sizes = ["--device", "cuda", "--dtype", "bfloat16", "--model-size", "1b", "--num-prompts", "64",
                        "--input-len", "128", "--output-len", "128", "--repeats", "2", "--threads", "8",
                        "--profile-steps", "16"]
        host_sizes = ["--device", "cuda", "--dtype", "bfloat16", "--model-size", "1b", "--batch", "64",
                      "--input-len", "128", "--output-len", "128", "--repeats", "2", "--threads", "8"]
        backends = "shm" + (",nixl" if a.modules.get("nixl") else "")
        kv_sizes = ["--device", "cuda", "--backends", backends, "--reps", "3", "--rounds", "1"]
        # The mixed workload at 8B: prompts 512..4k, outputs 128..512, 64 at once.
        pd_sizes = ["--device", "cuda", "--dtype", "bfloat16", "--backends", "shm,tcp", "--model-size", "8b",
                    "--num-requests", "64", "--input-len", "512", "--input-len-max", "4096", "--output-len", "128",
                    "--output-len-max", "512", "--concurrency", "64"]
        trace_sizes = ["--device", "cuda", "--reps", "12"]
        # Issue 51's GPU target at 8B, the copy workload only (free text / sampled and 1B: by hand, the page's
        # command); the plain side overlaps, as served by default.
        spec_sizes = ["--device", "cuda", "--dtype", "bfloat16", "--size", "8b", "--batches", "1,8", "--repeats", "3",
                      "--prompt-len", "512", "--cycle-search", "1024", "--new-tokens", "128", "--plain-overlap"]
    pd_sizes += ["--load-format", "dummy", "--log-dir", str(out / "pd_logs")]
    engine_sizes += ["--load-format", "dummy", "--hf-static", "--skip-hf-dynamic"]
    steps = [
        Step("scale", [*py, "benchmarks.model_scale", *scale_sizes, "--json", str(out / "scale.json")], 140),
        Step("pd", [*py, "benchmarks.gpu_pd", *pd_sizes, "--json", str(out / "pd.json")], 180),
        Step("kv", [*py, "benchmarks.kv_transfer", *kv_sizes, "--modes", "paged", "--json", str(out / "kv.json")], 60),
        # shm's landing signals (CUDA IPC events) against the kv step's default (off): issue 50's item 4. shm only (the
    # later --backends wins): the option is shm's.
        Step("kvsig", [*py, "benchmarks.kv_transfer", *kv_sizes, "--backends", "shm", "--modes", "paged", "--option",
                       "landing_signal=auto", "--json", str(out / "kvsig.json")], 60),
        Step("engine", [*py, "benchmarks.engine_throughput", *engine_sizes, "--warmup-full", "--json",
                        str(out / "engine.json")], 120),
        Step("spec", [*py, "benchmarks.spec_decode", *spec_sizes, "--load-format", "dummy", "--workloads", "copy",
                      "--json", str(out / "spec.json")], 90),
        tests,
        Step("host", [*py, "benchmarks.host_step", *host_sizes, "--json", str(out / "host.json")], 120),
        Step("kvtrace", [*py, "benchmarks.kvtrace.phases", "--run", "--backend", "shm", *trace_sizes, "--timeout",
                         "80", "--json", str(out / "kvtrace.json")], 90),
    ]
    # GPU only (inductor's CPU compile of even the tiny model outlasts the dry run): our decode steps compiled and
    # captured (--enable-torch-compile) against HF static + compiled.
    if not a.dry_run:
        steps.append(Step("compile", [*py, "benchmarks.engine_throughput", *engine_sizes, "--enable-torch-compile",
                                      "--torch-compile-max-bs", "64", "--warmup-full", "--json",
                                      str(out / "compile.json")], 240))
    return steps


def run_step(step: Step, out: Path, deadline: float, measure_cpu: bool = True, fork: bool = False) -> None:
    """Run ``step`` to its deadline; ``measure_cpu``: record its processes' CPU seconds (only right when no other
    step runs at the same time); ``fork``: start it by fork from this process (``forked_steps``: the CPU dry run)."""
    timeout = min(step.timeout_s, deadline - time.monotonic())
    log = out / f"{step.name}.log"
    if timeout < 5:
        step.result = {"status": "skipped", "reason": "the check's time budget ran out"}
        print(f"[{step.name}] skipped: no time left", flush=True)
        return
    print(f"[{step.name}] python {' '.join(step.argv)}  (deadline {timeout:.0f} s)", flush=True)
    t0 = time.monotonic()
    cpu0 = _children_cpu_s()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as f:
        proc: subprocess.Popen[bytes] | ForkedProcess = (
            ForkedProcess(step.argv, log, ROOT) if fork else
            subprocess.Popen([sys.executable, *step.argv], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                             start_new_session=True))
        try:
            rc: int | None = proc.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(KILL_GRACE_S)
            rc = proc.returncode
    seconds = time.monotonic() - t0
    status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
    tail = log.read_text(errors="replace")[-3000:]
    # CPU seconds of the step's processes (reaped ones: a step's children are waited for by their parents)
    step.result = {"status": status, "rc": rc, "seconds": round(seconds, 1),
                   "cpu_s": round(_children_cpu_s() - cpu0, 1) if measure_cpu else None, "log": log.name,
                   "log_tail": tail}
    result_file = out / f"{step.name}.json"
    if result_file.is_file():
        step.result["data"] = json.loads(result_file.read_text())
    if step.name == "tests":
        step.result["data"] = junit_counts(out / "tests.xml", tail)
    print(f"[{step.name}] {status} in {seconds:.0f} s, {step.result['cpu_s']} CPU s (rc {rc})", flush=True)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def junit_counts(path: Path, tail: str) -> dict[str, Any]:
    if not path.is_file():
        return {"junit": None, "summary_line": tail.strip().splitlines()[-1] if tail.strip() else ""}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    problems = []
    for case in suite.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                problems.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                                 "message": (node.get("message") or node.text or "")[:600]})
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return counts | {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
                     "problems": problems}


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "host_cores": os.cpu_count()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    import torch

    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        info |= {"gpu": torch.cuda.get_device_name(), "gpu_count": torch.cuda.device_count(),
                 "gpu_free_gib": round(free / 2**30, 1), "gpu_total_gib": round(total / 2**30, 1)}
    modules: dict[str, str | None] = {}
    for name in OPTIONAL_MODULES:
        try:
            mod = importlib.import_module(name)
            modules[name] = str(getattr(mod, "__version__", "loaded"))
        except Exception as e:  # a wheel that is absent or does not load here: recorded, not fatal
            modules[name] = None
            info.setdefault("module_errors", {})[name] = f"{type(e).__name__}: {e}"[:200]
    info["modules"] = modules
    return info


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=ROOT).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results" / "gpu_check"))
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: the same plumbing, no GPU needed")
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole check's deadline (seconds)")
    p.add_argument("--steps", default=None, help=f"which steps, comma-separated, of {','.join(STEPS)} (default: "
                   f"{DEFAULT_STEPS}; dry run: {DRY_RUN_STEPS})")
    p.add_argument("--jobs", type=int, default=1,
                   help="steps run at once: the CPU dry run's steps are independent (on a GPU they share the device "
                        "and its timings: keep 1)")
    p.add_argument("--pytest-args", default="", help="more pytest arguments for the tests step (e.g. -k EXPR)")
    p.add_argument("--timeout", action="append", default=[], metavar="STEP=SECONDS", help="a step's own deadline")
    p.add_argument("--commit", default=os.environ.get("PDCLUSTER_COMMIT") or _git_commit(), help="recorded in the summary")
    a = p.parse_args(argv)
    deadline = time.monotonic() + a.budget_s
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    # The dry run forks its steps from this process with their modules imported once (forked_steps: one thread,
    # so the environment, whose imports start threads, is read in a child).
    fork = a.dry_run and a.jobs == 1
    if fork:
        os.environ["PYTHONUNBUFFERED"] = "1"
        preload()
    env_info = in_child(environment) if fork else environment()
    a.modules = env_info["modules"]
    print(f"[env] {json.dumps(env_info)}", flush=True)
    if not a.dry_run and not env_info["cuda_available"]:
        print("no CUDA device here: run with --dry-run on CPU", file=sys.stderr)
    wanted = [s for s in (a.steps or (DRY_RUN_STEPS if a.dry_run else DEFAULT_STEPS)).split(",") if s]
    unknown = sorted(set(wanted) - set(STEPS))
    if unknown:
        p.error(f"--steps: unknown {unknown}; the steps are {', '.join(STEPS)}")
    steps = [s for s in steps_for(a, out) if s.name in wanted]
    for spec in a.timeout:
        name, _, seconds = spec.partition("=")
        for s in steps:
            if s.name == name:
                s.timeout_s = float(seconds)
    result: dict[str, Any] = {"started": started, "commit": a.commit, "dry_run": a.dry_run, "budget_s": a.budget_s,
                              "env": env_info, "steps": {}}
    lock = threading.Lock()

    def run(step: Step) -> None:
        run_step(step, out, deadline, measure_cpu=a.jobs == 1, fork=fork)
        with lock:  # what ran so far survives a kill, in step order
            result["steps"] = {s.name: s.result for s in steps if s.result}
            (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")

    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        list(pool.map(run, steps))
    result["seconds"] = round(a.budget_s - (deadline - time.monotonic()), 1)
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    page = summarize(result)
    (out / "summary.md").write_text(page)
    print(page, flush=True)
    return result


if __name__ == "__main__":
    main()
