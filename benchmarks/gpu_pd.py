"""``pdcluster up`` on one device: 1 prefill + 1 decode per KV backend, then a colocated node, the same streamed
greedy load through the router's OpenAI API each time (the GPU check's ``pd`` step; ``benchmarks/gpu_check.py``).

Per cluster: seconds from ``up`` to its ready line, each node's KV pool (from its log) and CUDA-graph capture time,
each node's KV pages and request slots before and after the load (all must come back: free, or held
only by the prefix cache), and the load's figures: ``--num-requests``
prompts of ``--input-len`` random token ids, ``--output-len`` tokens each (``ignore_eos``), ``--concurrency`` at
once, streamed; a mixed workload with ``--input-len-max`` / ``--output-len-max``: each request's lengths drawn
uniformly between the two (seeded, the same for every cluster). Each PD run's texts are compared with the colocated
run's, prompt by prompt.

    python -m benchmarks.gpu_pd --device cuda --backends shm,tcp --json out.json
    python3 -m benchmarks.gpu_pd --device cuda --dtype bfloat16 --model-size 8b --load-format dummy \
        --input-len 512 --input-len-max 4096 --output-len 128 --output-len-max 512 --concurrency 64 --json out.json
    python -m benchmarks.gpu_pd --device cpu --backends tcp --num-requests 8 --output-len 8 --model-size tiny  # dry run

No ``openai`` package here (GPU machines lack it): the client is ``aiohttp`` reading the SSE stream itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.up_runs import UpCluster, free_port  # noqa: E402

POOL_LINE = re.compile(r"KV cache on (\S+): (\d+) pages x (\d+) tokens \(([\d.]+) MiB\)")
CAPTURE_LINE = re.compile(r"(.+) done in ([\d.]+) s")
CHILD_GRPC = re.compile(r"^\s+(\S+)\s+pid \d+\s+grpc 127\.0\.0\.1:(\d+)", re.M)
READY_TIMEOUT_S = 240.0
POOLS_BACK_TIMEOUT_S = 30.0


def pool_state(port: int) -> dict[str, Any]:
    """A node's KV pages and request slots per DP rank (``GetLoad``, with the cluster credential)."""
    import grpc

    from common.wire.worker_auth import credential_metadata
    from pdcluster.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        load = worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=10,
                                                       metadata=credential_metadata())
    return {"page_size": load.page_size, "ranks": [
        {"free_kv_pages": r.free_kv_pages, "evictable_tokens": r.evictable_tokens, "total_kv_pages": r.total_kv_pages,
         "free_req_slots": r.free_req_slots, "total_req_slots": r.total_req_slots,
         "busy": r.running + r.waiting + r.bootstrap + r.inflight + r.prealloc + r.transfer} for r in load.ranks]}


def pools_free(state: dict[str, Any]) -> bool:
    """Every rank idle with all its KV pages (free, or held only by the prefix cache) and request slots back."""
    page = state["page_size"]
    return all(r["free_kv_pages"] * page + r["evictable_tokens"] >= r["total_kv_pages"] * page
               and r["free_req_slots"] == r["total_req_slots"] and r["busy"] == 0 for r in state["ranks"])


def node_facts(log: Path) -> dict[str, Any]:
    text = log.read_text(errors="replace") if log.is_file() else ""
    facts: dict[str, Any] = {}
    if m := POOL_LINE.search(text):
        facts["kv_pool"] = {"device": m[1], "pages": int(m[2]), "page_size": int(m[3]), "mib": float(m[4])}
    facts["capture"] = [{"line": m[0][-200:], "seconds": float(m[2])} for m in CAPTURE_LINE.finditer(text)]
    return facts


async def _one(session: Any, url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    import aiohttp

    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    chunks = 0
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return {"ok": False, "error": f"HTTP {r.status}: {(await r.text())[:300]}"}
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return {"ok": False, "error": str(event["error"])[:300]}
                piece = "".join(c.get("text") or "" for c in event.get("choices", []))
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
                chunks += 1
    except (aiohttp.ClientError, TimeoutError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    return {"ok": True, "text": "".join(text), "ttft_s": ttft, "seconds": time.perf_counter() - t0, "chunks": chunks}


async def drive(http_port: int, prompts: list[list[int]], warm: list[list[int]], outputs: list[int], warm_output: int,
                concurrency: int, timeout_s: float) -> dict[str, Any]:
    import aiohttp

    base = f"http://127.0.0.1:{http_port}/v1"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
            model = (await r.json())["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency)

        async def send(ids: list[int], output_len: int) -> dict[str, Any]:
            body = {"model": model, "prompt": ids, "max_tokens": output_len, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            async with gate:
                return await _one(session, f"{base}/completions", body, timeout_s)

        # Warm-up, as concurrent as the load: first-use costs (kernel compiles for new batch shapes, first transfers
        # to a peer) stay out of the figures. Other prompts than the load's, so no prefix-cache hit carries over.
        await asyncio.gather(*(send(p, warm_output) for p in warm))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(send(p, n) for p, n in zip(prompts, outputs, strict=True)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft_s"] for r in ok if r["ttft_s"] is not None)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "wall_s": wall, "request_per_s": len(ok) / wall,
        "output_tok_per_s": sum(n for r, n in zip(results, outputs, strict=True) if r["ok"]) / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else None,
        "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        "texts": [r.get("text") for r in results],
    }


def run_cluster(name: str, up_args: list[str], a: argparse.Namespace, prompts: list[list[int]],
                outputs: list[int], warm: list[list[int]], work: Path) -> dict[str, Any]:
    cluster = UpCluster([*up_args, "--model-path", a.model_path, "--device", a.device, "--dtype", a.dtype,
                         "--load-format", a.load_format, *a.node_flag],
                        work / f"{name}.log", free_port(), free_port())
    out: dict[str, Any] = {"name": name}
    t0 = time.monotonic()
    cluster.start()
    try:
        cluster.wait_ready(READY_TIMEOUT_S)
        out["startup_s"] = time.monotonic() - t0
        log = cluster.log.read_text(errors="replace")
        ports = {n: int(p) for n, p in CHILD_GRPC.findall(log) if n != "router"}
        out["nodes"] = {n: node_facts(work / name / f"{n}.log") for n in ports}
        out["pools_before"] = {n: pool_state(p) for n, p in ports.items()}
        out["load"] = asyncio.run(drive(cluster.http_port, prompts, warm, outputs, a.output_len, a.concurrency,
                                        a.request_timeout))
        deadline = time.monotonic() + POOLS_BACK_TIMEOUT_S
        while True:
            after = {n: pool_state(p) for n, p in ports.items()}
            if all(pools_free(s) for s in after.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        out["pools_after"] = after
        out["pools_back"] = all(pools_free(s) for s in after.values())
    except Exception as e:  # recorded: the next cluster still runs
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        out["stop_exit_code"] = cluster.stop()
    print(f"{name}: " + json.dumps({k: v for k, v in out.items() if k != "load"} |
                                   {"load": {k: v for k, v in out.get("load", {}).items() if k != "texts"}}),
          flush=True)
    return out


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    # gpu_check ends a step past its deadline with SIGTERM to the step's process group; ``up`` runs in a session of
    # its own, so it would outlive the step with its whole cluster. As SystemExit, ``run_cluster``'s finally stops it.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model-path", default=None, help="default: generate the --model-size llama (seed 0)")
    p.add_argument("--model-size", default="small", help="the generated llama's size (tiny for the CPU dry run)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="the nodes' --load-format (dummy: the generated folder holds no weights)")
    p.add_argument("--backends", default="shm,tcp")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--input-len-max", type=int, default=None, help="mixed workload: prompts up to this long")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-len-max", type=int, default=None, help="mixed workload: outputs up to this long")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--node-flag", action="append", default=[], help="one more flag for every node (repeatable)")
    p.add_argument("--log-dir", default=None, help="keep every cluster's logs here (default: a temporary folder)")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    from common.wire.security import CLUSTER_TOKEN_ENV, generate_cluster_token

    os.environ.setdefault(CLUSTER_TOKEN_ENV, generate_cluster_token())  # up hands it to its nodes; GetLoad shows it
    with tempfile.TemporaryDirectory(prefix="pdc-gpu-pd-") as tmp:
        work = Path(a.log_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if a.model_path is None:
            from common.model_gen.make_model import make_model

            a.model_path = str(make_model("llama", a.model_size, Path(tmp) / "model", seed=0,
                                          weights=False if a.load_format == "dummy" else None))
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(a.model_path).vocab_size
        rng = random.Random(0)
        lens = [rng.randint(a.input_len, a.input_len_max or a.input_len) for _ in range(a.num_requests)]
        outputs = [rng.randint(a.output_len, a.output_len_max or a.output_len) for _ in range(a.num_requests)]
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]
        # NOTE: the warm-up is as concurrent as the load (Triton specialises kernels on their integer arguments: a
        # new batch size can mean a compile), and colocated runs last: on a fresh machine the first cluster meets
        # Triton's cold compile cache (benchmarks/pages/gpu_check.md).
        warm = [[rng.randrange(3, vocab) for _ in range(a.input_len)] for _ in range(a.concurrency)]
        result: dict[str, Any] = {"args": vars(a), "runs": {}}
        plans = [(f"pd_{b}", ["--prefill", "1", "--decode", "1", "--kv-transfer-backend", b])
                 for b in a.backends.split(",") if b]
        plans += [("colocated", ["--prefill", "0", "--decode", "0", "--colocated", "1"])]
        for name, up_args in plans:
            result["runs"][name] = run_cluster(name, up_args, a, prompts, outputs, warm, work)
            Path(a.json).write_text(json.dumps(result, indent=2) + "\n")  # what ran so far survives a kill
    want = result["runs"]["colocated"].get("load", {}).get("texts")
    for name, run in result["runs"].items():
        got = run.get("load", {}).get("texts")
        if name != "colocated" and want and got:
            same = sum(x is not None and x == y for x, y in zip(got, want, strict=True))
            run["identical_to_colocated"] = same / len(want)
            print(f"{name}: {same}/{len(want)} texts identical to colocated", flush=True)
    Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
