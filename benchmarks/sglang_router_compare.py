"""Our router versus SGLang's router (``sglang-router``, Rust) in front of the same prefill and decode nodes.

One prefill and one decode node (tiny generated model, ``--sglang-http-port``) serve both at once: our router over
the Worker gRPC API, sglang-router (``--pd-disaggregation``) over the nodes' SGLang HTTP API. The same closed-loop
OpenAI client (streaming, ``ignore_eos``) drives each router in turn, alternating phases (ours, sglang, ours,
sglang, ...; the order turns each round) so drift on a shared machine hits both alike. Both routers run the same
policies (``--prefill-policy``, ``--decode-policy``; default: cache_aware prefill, as both routers default to, and
round robin over the one decode node). Reported per router: req/s, TTFT and e2e percentiles, and the router's CPU
time per request (from /proc: the router process and its children, e.g. our tokenize workers).

Workloads (``--workload``): ``random`` - ``/v1/completions`` with text prompts of ``--input-len`` random token ids
decoded, every prompt new (no tokenizer cache can help); ``chat`` - ``/v1/chat/completions`` conversations of
``--turns`` user turns behind one shared system prompt (``--system-len`` tokens), each turn's request carrying the
conversation so far. ``--baseline DIR`` adds a third router: ours as checked out in DIR (a ``git worktree`` of an
earlier commit), for a before/after in the same run; ``--ours-arg`` passes flags to our router (not the baseline).

    .venv/bin/python -m benchmarks.sglang_router_compare --requests 200 --concurrency 8 --rounds 2
    .venv/bin/python -m benchmarks.sglang_router_compare --workload chat --baseline ../base \
        --ours-arg=--tokenizer-cache-enable-l0 --ours-arg=--tokenizer-cache-enable-l1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.bench import machine
from benchmarks.loadgen.clients import OpenAIClient
from benchmarks.loadgen.runner import LoadShape, run_load
from benchmarks.loadgen.stats import RequestResult, summarize
from benchmarks.loadgen.workload import RequestSpec, WorkloadConfig, make_workload
from common.ports import pick_free_port
from common.text.tokenizer import load_tokenizer

ROUTERS = ("ours", "sglang", "base")
POLICIES = ("round_robin", "random", "power_of_two", "cache_aware")  # both routers have these


class TextClient(OpenAIClient):
    """Streaming ``/v1/completions`` with the spec's prompt as text: sglang-router 0.3.2 refuses token-id prompts
    (422 "prompt: data did not match any variant of untagged enum StringOrArray")."""

    def __init__(self, base_url: str, model: str, tokenizer: Any) -> None:
        super().__init__(base_url, model=model)
        self.tokenizer = tokenizer

    async def send(self, spec: RequestSpec, t0: float) -> RequestResult:
        if spec.messages is not None:
            return await super().send(spec, t0)
        r = RequestResult(spec.index, spec.kind, time.perf_counter() - t0, prompt_tokens=spec.prompt_len)
        sent = time.perf_counter()
        try:
            stream = await self.client.completions.create(
                model=self.model, prompt=self.tokenizer.decode(spec.prompt_ids), max_tokens=spec.max_tokens,
                temperature=0.0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    r.ttft = now - sent if r.ttft is None else r.ttft
                    r.token_times.append(now - t0)
                self._finish(r, chunk)
            r.e2e = time.perf_counter() - sent
        except Exception as e:  # a failed request is a result, not a crash of the run
            r.error = type(e).__name__
            r.ok = False
        return r


def _spawn(cmd: list[str], log: Path, cores: str | None = None, tree: Path | None = None) -> subprocess.Popen[bytes]:
    """``tree``: run the command from that checkout (its own code first on the path)."""
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    env = None if tree is None else {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (tree, tree / "proto")))}
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tree, env=env)


def _wait(url: str, body: bytes, procs: list[subprocess.Popen[bytes]], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if body in resp.read():
                    return
        except OSError:
            pass
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready")


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _cpu_s(pid: int) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its living descendants (ours tokenizes large prompts in worker processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(int(_stat(int(entry))[1]), []).append(int(entry))
            except (OSError, IndexError):
                continue  # gone meanwhile
    tree, todo, total = [], [pid], 0.0
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in tree:
        try:
            total += _cpu_s(p)
        except OSError:
            continue
    return total


def _start(model: str, tmp: Path, procs: list[subprocess.Popen[bytes]], args: argparse.Namespace,
           ) -> dict[str, tuple[str, int]]:
    """The two nodes and the routers, each appended to ``procs`` as it starts (the caller ends them, also when
    this fails)."""
    prefill_policy, decode_policy = args.prefill_policy, args.decode_policy
    ports = {name: pick_free_port() for name in ("p", "pb", "ph", "d", "dh", "sgl", "prom")}
    for mode, core, grpc_port, http_port, boot in (("prefill", "0", "p", "ph", "pb"), ("decode", "1", "d", "dh", "pb")):
        procs.append(_spawn(
            [sys.executable, "-m", "common.app.cli", "serve", "--model-path", model, "--host", "127.0.0.1",
             "--port", str(ports[grpc_port]), "--disaggregation-mode", mode,
             "--disaggregation-bootstrap-port", str(ports[boot] if mode == "prefill" else pick_free_port()),
             "--sglang-http-port", str(ports[http_port]), "--torch-num-threads", "1",
             "--max-total-tokens", str(args.max_total_tokens),
             "--kv-transfer-backend", "tcp"], tmp / f"{mode}.log", core))
    for name in ("ph", "dh"):
        _wait(f"http://127.0.0.1:{ports[name]}/health_generate", b"", procs)
    ours: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
    for name, tree, extra in (("ours", None, args.ours_arg), ("base", args.baseline, [])):
        if name == "base" and tree is None:
            continue
        port = pick_free_port()
        ours[name] = port, _spawn(
            [sys.executable, "-m", "common.app.cli", "router", "--model-path", model, "--host", "127.0.0.1",
             "--http-port", str(port), "--grpc-port", str(pick_free_port()),
             "--prefill", f"127.0.0.1:{ports['p']}:{ports['pb']}", "--decode", f"127.0.0.1:{ports['d']}",
             "--prefill-policy", prefill_policy, "--decode-policy", decode_policy, *extra],
            tmp / f"{name}.log", tree=tree)
    sgl = _spawn([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                  "--port", str(ports["sgl"]), "--pd-disaggregation",
                  "--prefill", f"http://127.0.0.1:{ports['ph']}", str(ports["pb"]),
                  "--decode", f"http://127.0.0.1:{ports['dh']}", "--prefill-policy", prefill_policy,
                  "--decode-policy", decode_policy, "--model-path", model,
                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports["prom"]), "--log-level", "warn"],
                 tmp / "sglang.log")
    procs.append(sgl)
    procs += [p for _, p in ours.values()]
    for port, _ in ours.values():
        _wait(f"http://127.0.0.1:{port}/health", b'"ok"', procs)
    _wait(f"http://127.0.0.1:{ports['sgl']}/readiness", b'"ready"', procs)
    return {"sglang": (f"http://127.0.0.1:{ports['sgl']}/v1", sgl.pid),
            **{name: (f"http://127.0.0.1:{port}/v1", p.pid) for name, (port, p) in ours.items()}}


async def _phase(url: str, pid: int, fronts: list[int], model: str, tokenizer: Any, args: argparse.Namespace,
                 seed: int) -> dict[str, Any]:
    client = TextClient(url, model, tokenizer)
    kind = "multi-turn" if args.workload == "chat" else "fixed"
    shape = {"kind": kind, "input_len": args.input_len, "prefix_len": args.system_len, "turns": args.turns,
             "groups": 1}
    warm = WorkloadConfig(**shape, num_requests=8, output_len=4, seed=seed + 1000)
    await run_load(client, make_workload(warm), LoadShape(concurrency=4, progress=False))
    wl = WorkloadConfig(**shape, num_requests=args.requests, output_len=args.output_len, seed=seed)
    cpu0, fronts0 = _tree_cpu_s(pid), sum(map(_cpu_s, fronts))
    run = await run_load(client, make_workload(wl), LoadShape(concurrency=args.concurrency, progress=False,
                                                              time_limit_s=args.time_limit))
    cpu, fronts_cpu = _tree_cpu_s(pid) - cpu0, sum(map(_cpu_s, fronts)) - fronts0
    await client.close()
    s = summarize(run.results, run.wall_s)
    return {"req_s": s["request_throughput"], "completed": s["completed"], "errors": s["errors"],
            "ttft_p50_ms": s["ttft"].get("p50_ms"), "ttft_p99_ms": s["ttft"].get("p99_ms"),
            "e2e_p50_ms": s["e2e"].get("p50_ms"), "e2e_p99_ms": s["e2e"].get("p99_ms"),
            "router_cpu_ms_per_req": round(1000 * cpu / max(s["completed"], 1), 3),
            # the nodes' front processes (tokenize/detokenize there behind sglang-router; ranks not counted)
            "node_fronts_cpu_ms_per_req": round(1000 * fronts_cpu / max(s["completed"], 1), 3),
            "loadavg": machine()["loadavg"]}


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    from common.model_gen.make_model import make_model
    from common.wire.security import CLUSTER_TOKEN_ENV, generate_cluster_token

    os.environ.setdefault(CLUSTER_TOKEN_ENV, generate_cluster_token())  # inherited by the nodes and our router

    tmp = Path(tempfile.mkdtemp(prefix="pdcluster-sglang-compare-"))
    model = args.model or str(make_model("llama", "tiny", tmp / "model", seed=0))
    procs: list[subprocess.Popen[bytes]] = []
    phases: list[dict[str, Any]] = []
    try:
        routers = _start(model, tmp, procs, args)
        name = Path(model).name
        tokenizer = load_tokenizer(model)
        fronts = [procs[0].pid, procs[1].pid]  # the prefill and decode nodes' front processes
        order = [r for r in ROUTERS if r in routers]
        for r in range(args.rounds):
            for router in order[r % len(order):] + order[: r % len(order)]:
                url, pid = routers[router]
                phases.append({"router": router, "round": r, **await _phase(url, pid, fronts, name, tokenizer, args, seed=r)})
                print(json.dumps(phases[-1]), flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {"config": config, "machine": machine(), "phases": phases, "logs": str(tmp)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: a tiny generated llama)")
    ap.add_argument("--requests", type=int, default=200, help="requests per phase")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="alternating phases per router")
    ap.add_argument("--workload", choices=("random", "chat"), default="random",
                    help="random: new random-token text prompts (completions); chat: multi-turn conversations "
                         "behind one shared system prompt (chat completions)")
    ap.add_argument("--system-len", type=int, default=256, help="chat: system prompt tokens (about)")
    ap.add_argument("--turns", type=int, default=4, help="chat: user turns per conversation")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a checkout of an earlier commit (git worktree): its router runs too, as 'base'")
    ap.add_argument("--ours-arg", action="append", default=[],
                    help="a flag for our router, not the baseline (repeatable; --ours-arg=--flag)")
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="each node's KV pool, tokens")
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--prefill-policy", default="cache_aware", choices=POLICIES, help="both routers'")
    ap.add_argument("--decode-policy", default="round_robin", choices=POLICIES,
                    help="both routers' (sglang-router refuses power_of_two with one decode worker)")
    ap.add_argument("--out", default="benchmarks/results/sglang_router_compare.json")
    args = ap.parse_args()
    result = asyncio.run(_main(args))
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
