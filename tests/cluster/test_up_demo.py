"""``pdcluster up --demo`` (the ``make up`` path, on the tiny model): it prints the router's and every node's
endpoints, its demo requests get answers, every printed endpoint answers (HTTP, and gRPC reflection listing the
Router on the router and the Worker on each node, with health), and SIGINT stops it and every child cleanly.

The same cluster is the abuse target of issue 54 (one cluster start for both: CI time), run with an API key file,
``--max-client-priority 0``, ``--sglang-http`` and a router flag passed through (``--tool-call-parser``):
twelve loopback hosts holding their unauthenticated slots on the decode node's SGLang HTTP port leave a keyed client
served within a second; a priority over the ceiling is refused, the admin token's is not; a chat request with
``tools`` and the default ``tool_choice`` is answered. The tests run in file order (one worker takes the file)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.node.conn_budget import PRE_AUTH_PER_PEER, PRE_AUTH_TOTAL
from common.ports import pick_free_port
from tests.grpc_helpers import reflected_services
from tests.model_fixtures import make_tiny_model

pytestmark = pytest.mark.slow  # four processes

READY_TIMEOUT_S = 240
DEMO_TIMEOUT_S = 90  # from "pdcluster ready" to the demo's last line
DEMO_DONE = re.compile(r"\[completions\] '(.*)'\n  usage: (\{.*\})\n\[chat, streamed\] (.*)\n\n", re.S)
READY = re.compile(r"pdcluster ready: OpenAI (http://\S+)/v1  gRPC (\S+)")
CHILD = re.compile(r"^  (\S+)\s+pid (\d+)\s+grpc (\S+)(?:.*sglang (http://\S+))?", re.M)
KEY, ADMIN = "sk-ordinary-0123456789abcdef", "admin-token-0123456789abcdef"
FLOOD_HOSTS = PRE_AUTH_TOTAL // PRE_AUTH_PER_PEER + 4  # more than the total bound holds


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    out: Path
    text: str  # up's output up to the demo's end
    http: str
    grpc: str
    children: dict[str, tuple[int, str, str | None]]  # name -> (pid, grpc address, SGLang HTTP base)

    def request(self, path: str, body: dict[str, Any] | None = None, key: str = KEY) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(f"{self.http}{path}", json.dumps(body).encode() if body else None,
                                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("up")
    http_port, grpc_port = pick_free_port(), pick_free_port()
    out_path = tmp / "up.out"
    (tmp / "keys").write_text(f"# the nodes' SGLang ports take the first key\n{KEY}\n")
    cmd = [sys.executable, "-m", "common.app.cli", "up", "--demo", "--model-path", str(make_tiny_model("llama")),
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--log-dir", str(tmp / "logs"),
           "--max-total-tokens", "4096", "--api-key-file", str(tmp / "keys"), "--sglang-http",
           "--enable-priority-scheduling", "--max-client-priority", "0", "--tool-call-parser", "qwen25"]
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PDCLUSTER_ADMIN_TOKEN": ADMIN})
    children: dict[str, tuple[int, str, str | None]] = {}
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while (ready := READY.search(text := out_path.read_text())) is None:
            assert proc.poll() is None, f"pdcluster up exited with {proc.returncode}:\n{text[-4000:]}"
            assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s:\n{text[-4000:]}"
            time.sleep(0.2)
        children = {name: (int(pid), addr, sglang or None) for name, pid, addr, sglang in CHILD.findall(text)}
        deadline = time.monotonic() + DEMO_TIMEOUT_S
        while DEMO_DONE.search(text := out_path.read_text()) is None:
            assert proc.poll() is None, f"pdcluster up exited with {proc.returncode}:\n{text[-4000:]}"
            assert time.monotonic() < deadline, f"no demo answers {DEMO_TIMEOUT_S} s after ready:\n{text[-4000:]}"
            time.sleep(0.2)
        assert ready.group(1) == f"http://127.0.0.1:{http_port}" and ready.group(2) == f"127.0.0.1:{grpc_port}"
        yield Up(proc, out_path, text, ready.group(1), ready.group(2), children)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for pid, _, _ in children.values():  # a child that outlived a failed stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)


def test_up_demo_prints_endpoints_and_answers(up: Up) -> None:
    roles = sorted(re.sub(r"-?\d+$", "", name) for name in up.children)
    assert roles == ["decode", "prefill", "router"], f"endpoints printed: {up.children}"
    demo = DEMO_DONE.search(up.text)
    assert demo is not None
    usage = json.loads(demo.group(2))
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 24, usage
    assert demo.group(1) and demo.group(3).strip(), "a demo request got no text back"

    status, models = up.request("/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [make_tiny_model("llama").name]
    router = reflected_services(up.grpc)
    assert {"pdcluster.v1.Router", "grpc.health.v1.Health"} <= set(router), sorted(router)
    for name, (_, addr, sglang) in up.children.items():
        if not name.startswith("router"):
            worker = reflected_services(addr)
            assert {"pdcluster.v1.Worker", "grpc.health.v1.Health"} <= set(worker), (name, sorted(worker))
            assert "Prefill" in worker["pdcluster.v1.Worker"]
            assert sglang is not None, f"{name}: --sglang-http printed no SGLang port"


async def test_a_flood_of_unauthenticated_connections_leaves_a_keyed_client_served(up: Up) -> None:
    sglang = up.children["decode-0"][2]
    assert sglang is not None
    port = int(sglang.rsplit(":", 1)[1])
    held: list[asyncio.StreamWriter] = []
    try:
        for host in range(2, 2 + FLOOD_HOSTS):  # each host its whole per-peer bound, the total over its bound
            for _ in range(PRE_AUTH_PER_PEER):
                _r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(f"127.0.0.{host}", 0))
                held.append(w)
        async with aiohttp.ClientSession() as s:
            for key, status in ((KEY, 200), ("not-the-key", 401)):
                r = await asyncio.wait_for(s.get(f"{sglang}/get_server_info",
                                                 headers={"Authorization": f"Bearer {key}"}), 1.0)
                assert r.status == status
        assert up.request("/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200  # the router's path too
    finally:
        for w in held:
            w.close()


def test_a_priority_over_the_ceiling_is_refused_but_the_admin_tokens_is_not(up: Up) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "priority": 2**31 - 1}
    status, error = up.request("/v1/completions", body)
    assert status == 400 and "--max-client-priority" in error["error"]["message"]
    assert up.request("/v1/completions", {**body, "priority": 0})[0] == 200
    assert up.request("/v1/completions", body, key=ADMIN)[0] == 200


def test_tools_with_the_default_tool_choice_are_answered(up: Up) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    status, body = up.request("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool], "max_tokens": 8})
    assert status == 200, body  # tool_choice auto, read by the router's --tool-call-parser passed through up
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_sigint_stops_up_and_every_child(up: Up) -> None:
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(60) == 0, up.out.read_text()[-3000:]
    assert up.out.read_text().rstrip().endswith("pdcluster stopped")
    for name, (pid, _, _) in up.children.items():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"{name} (pid {pid}) outlived pdcluster up")
