"""Where a request's time to first token goes, P/D against colocated: ``up`` defaults, the small llama (seed 0),
128-token prompts, 64-token streams, a closed loop of 32 through the OpenAI API; the medians of the router's
per-request timing (``/v1/requests/<id>/timing``: queue, bootstrap, prefill, transfer, decode queue) over the run.

    .venv/bin/python -m benchmarks.ttft_phases --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai

from common.model_gen.make_model import make_model
from common.ports import pick_free_port

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "ttft-phases-local-only"  # this run's own cluster secret (the admin token of its timing endpoint)
TOPOLOGIES = {"pd": ["--prefill", "1", "--decode", "1"],
              "colocated": ["--prefill", "0", "--decode", "0", "--colocated", "1"]}


def start_up(topo: list[str], http_port: int, model: str, log_dir: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "common.app.cli", "up", "--model-path", model, "--http-port", str(http_port),
           "--grpc-port", str(pick_free_port()), "--max-total-tokens", "32768", "--log-dir", str(log_dir), *topo]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'proto'}", "PDCLUSTER_CLUSTER_TOKEN": TOKEN}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=ROOT, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "ready" in line.lower():
            return proc
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"up did not get ready; see {log_dir}")


async def closed_loop(port: int, n: int, concurrency: int, output_len: int, first: int) -> list[tuple[str, float]]:
    """(response id, client TTFT) of ``n`` streamed completions, ``concurrency`` in flight."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                timeout=120)
    model = (await client.models.list()).data[0].id
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> tuple[str, float]:
        async with slots:
            prompt = [(7 * i + 3 * j) % 7000 + 10 for j in range(128)]
            sent, ttft, rid = time.perf_counter(), 0.0, ""
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=output_len, stream=True,
                                                     temperature=0.0, extra_body={"ignore_eos": True})
            async for chunk in stream:
                rid = chunk.id
                if not ttft and chunk.choices and chunk.choices[0].text is not None:
                    ttft = time.perf_counter() - sent
            return rid, ttft

    try:
        return await asyncio.gather(*(one(first + i) for i in range(n)))
    finally:
        await client.close()


def timing(port: int, rid: str) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/requests/{rid}/timing",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())["timing"]


def run(name: str, model: str, a: argparse.Namespace, tmp: Path) -> dict[str, float]:
    port = pick_free_port()
    proc = start_up(TOPOLOGIES[name], port, model, tmp / f"log_{name}")
    try:
        asyncio.run(closed_loop(port, a.concurrency, a.concurrency, 8, 10**6))  # warm-up
        done = asyncio.run(closed_loop(port, a.requests, a.concurrency, a.output_len, 0))
        rows = [timing(port, rid) for rid, _ in done]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    medians = {k: round(statistics.median(r[k] for r in rows), 4) for k, v in rows[0].items()
               if isinstance(v, float | int) and not isinstance(v, bool)}
    medians["client_ttft"] = round(statistics.median(t for _, t in done), 4)
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ttft-phases-") as d:
        tmp = Path(d)
        model = str(make_model("llama", "small", tmp / "model", seed=0))
        out = {name: run(name, model, a, tmp) for name in TOPOLOGIES}
    for name, medians in out.items():
        print(name, json.dumps(medians))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
