"""``pdcluster up --demo`` (the ``make up`` path, on the tiny model): it prints the router's and every node's
endpoints, its demo requests get answers, every printed endpoint answers (HTTP, and gRPC reflection listing the
Router on the router and the Worker on each node, with health), and SIGINT stops it and every child cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from common.ports import pick_free_port
from tests.grpc_helpers import reflected_services
from tests.model_fixtures import make_tiny_model

pytestmark = pytest.mark.slow  # four processes

READY_TIMEOUT_S = 240
DEMO_TIMEOUT_S = 90  # from "pdcluster ready" to the demo's last line
DEMO_DONE = re.compile(r"\[completions\] '(.*)'\n  usage: (\{.*\})\n\[chat, streamed\] (.*)\n\n", re.S)
READY = re.compile(r"pdcluster ready: OpenAI (http://\S+)/v1  gRPC (\S+)")
CHILD = re.compile(r"^  (\S+)\s+pid (\d+)\s+grpc (\S+)", re.M)


def test_up_demo_prints_endpoints_answers_and_stops_on_sigint(tmp_path: Path) -> None:
    http_port, grpc_port = pick_free_port(), pick_free_port()
    out_path = tmp_path / "up.out"
    cmd = [sys.executable, "-m", "common.app.cli", "up", "--demo", "--model-path", str(make_tiny_model("llama")),
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--log-dir", str(tmp_path / "logs"),
           "--max-total-tokens", "4096"]
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    children: dict[str, tuple[int, str]] = {}
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while (ready := READY.search(text := out_path.read_text())) is None:
            assert proc.poll() is None, f"pdcluster up exited with {proc.returncode}:\n{text[-4000:]}"
            assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s:\n{text[-4000:]}"
            time.sleep(0.2)
        deadline = time.monotonic() + DEMO_TIMEOUT_S
        while (demo := DEMO_DONE.search(text := out_path.read_text())) is None:
            assert proc.poll() is None, f"pdcluster up exited with {proc.returncode}:\n{text[-4000:]}"
            assert time.monotonic() < deadline, f"no demo answers {DEMO_TIMEOUT_S} s after ready:\n{text[-4000:]}"
            time.sleep(0.2)
        assert ready.group(1) == f"http://127.0.0.1:{http_port}" and ready.group(2) == f"127.0.0.1:{grpc_port}"
        children = {name: (int(pid), addr) for name, pid, addr in CHILD.findall(text)}
        roles = sorted(re.sub(r"-?\d+$", "", name) for name in children)
        assert roles == ["decode", "prefill", "router"], f"endpoints printed: {children}"

        usage = json.loads(demo.group(2))
        assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 24, usage
        assert demo.group(1) and demo.group(3).strip(), "a demo request got no text back"

        with urllib.request.urlopen(f"{ready.group(1)}/v1/models", timeout=10) as resp:
            models = json.load(resp)
        assert [m["id"] for m in models["data"]] == [make_tiny_model("llama").name]
        router = reflected_services(ready.group(2))
        assert {"pdcluster.v1.Router", "grpc.health.v1.Health"} <= set(router), sorted(router)
        for name, (_, addr) in children.items():
            if not name.startswith("router"):
                worker = reflected_services(addr)
                assert {"pdcluster.v1.Worker", "grpc.health.v1.Health"} <= set(worker), (name, sorted(worker))
                assert "Prefill" in worker["pdcluster.v1.Worker"]

        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, out_path.read_text()[-3000:]
        assert out_path.read_text().rstrip().endswith("pdcluster stopped")
        for name, (pid, _) in children.items():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            raise AssertionError(f"{name} (pid {pid}) outlived pdcluster up")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for pid, _ in children.values():  # a child that outlived a failed stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
