"""Our prefill and decode nodes behind SGLang's own router (the real ``sglang-router`` binary, PD mode, HTTP):
``--sglang-http-port`` serves SGLang's worker API; greedy outputs through sglang-router equal our router's, and a
client that goes away mid-stream frees both nodes."""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.node_helpers import Node, free_port, start_node

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 90.0
PROMPTS = ["The quick brown fox", "Disaggregated serving moves KV caches " * 12, "a"]


def _sglang_router_available() -> bool:
    try:
        import sglang_router.sglang_router_rs  # noqa: F401  (the Rust binary)
    except ImportError:
        return False
    return True


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _spawn(cmd: list[str], port: int) -> Server:
    log = Path(tempfile.mkstemp(prefix="pdcluster-sglang-test-", suffix=".log")[1])
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return Server(proc, port, log)


def _wait_ready(server: Server, path: str, body: bytes) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.proc.args} exited with {server.proc.returncode}:\n"
                               f"{server.log.read_text()[-4000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(server.url + path, timeout=2) as resp:
            if body in resp.read():
                return
        time.sleep(0.3)
    raise TimeoutError(f"{server.proc.args} not ready in {START_TIMEOUT_S} s:\n{server.log.read_text()[-4000:]}")


@dataclass
class Stack:
    prefill: Node
    decode: Node
    prefill_http: int
    decode_http: int
    sglang: Server  # sglang-router in front of the two nodes' SGLang HTTP API
    ours: Server  # our router (OpenAI HTTP) in front of the same nodes' Worker gRPC
    model: str  # the served model name


@pytest.fixture(scope="module")
def stack(model_path) -> Iterator[Stack]:
    if not _sglang_router_available():
        pytest.skip("sglang-router is not installed (pip install sglang-router==0.3.2)")
    p_http, d_http = free_port(), free_port()
    # the nodes start side by side, then the two routers (sglang-router registers only healthy workers)
    nodes = [start_node(mode, model_path, extra=["--sglang-http-port", str(port), "--log-requests"], wait=False)
             for mode, port in (("prefill", p_http), ("decode", d_http))]
    prefill, decode = nodes
    servers: list[Server] = []
    try:
        for node in nodes:
            node.wait_ready()
        port = free_port()
        servers.append(_spawn(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--pd-disaggregation", "--prefill", f"http://127.0.0.1:{p_http}", str(prefill.bootstrap_port),
             "--decode", f"http://127.0.0.1:{d_http}", "--policy", "round_robin", "--model-path", str(model_path),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--disable-retries"], port))
        port = free_port()
        servers.append(_spawn(
            [sys.executable, "-m", "common.app.cli", "router", "--model-path", str(model_path), "--host", "127.0.0.1",
             "--grpc-port", str(free_port()), "--http-port", str(port),
             "--prefill", f"{prefill.addr}:{prefill.bootstrap_port}", "--decode", decode.addr], port))
        _wait_ready(servers[0], "/readiness", b'"ready"')
        _wait_ready(servers[1], "/health", b'"ok"')
        yield Stack(prefill, decode, p_http, d_http, servers[0], servers[1], Path(model_path).name)
    finally:
        for proc in [*(s.proc for s in servers), prefill.proc, decode.proc]:
            if proc.poll() is None:
                proc.terminate()  # all at once: each then stops within its own drain time
        for server in servers:
            server.stop()
        prefill.stop()
        decode.stop()


def post(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    if raw.startswith(b"data: "):
        events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", raw[-500:]
        return status, [json.loads(e) for e in events[:-1]]
    return status, json.loads(raw)


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read() or b"null") if resp.status == 200 else None


def test_greedy_outputs_match_our_router(stack: Stack) -> None:
    wants: dict[str, str] = {}
    for prompt in PROMPTS:
        _, ours = post(stack.ours.url + "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                            "ignore_eos": True})
        want = wants[prompt] = ours["choices"][0]["text"]
        assert ours["usage"]["completion_tokens"] == 12
        sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        status, got = post(stack.sglang.url + "/generate", {"text": prompt, "sampling_params": sp})
        assert status == 200, got
        assert got["text"] == want and len(got["output_ids"]) == 12
        meta = got["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["completion_tokens"] == 12 and meta["prompt_tokens"] == ours["usage"]["prompt_tokens"]
        status, chunks = post(stack.sglang.url + "/generate", {"text": prompt, "sampling_params": sp, "stream": True,
                                                               "return_logprob": True})
        assert status == 200, chunks
        last = chunks[-1]
        assert last["text"] == want and last["output_ids"] == got["output_ids"]
        assert [lp[1] for lp in last["meta_info"]["output_token_logprobs"]] == got["output_ids"]
        status, comp = post(stack.sglang.url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 12,
                                                                   "temperature": 0, "ignore_eos": True})
        assert status == 200, comp
        assert comp["choices"][0]["text"] == want and comp["usage"] == ours["usage"] | {
            "prompt_tokens_details": comp["usage"]["prompt_tokens_details"]}
    # chat: the node renders the model's chat template as our router does
    chat = {"model": stack.model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    _, ours_chat = post(stack.ours.url + "/v1/chat/completions", chat)
    status, chat_got = post(stack.sglang.url + "/v1/chat/completions", chat)
    assert status == 200, chat_got
    assert chat_got["choices"][0]["message"]["content"] == ours_chat["choices"][0]["message"]["content"]
    assert chat_got["usage"]["prompt_tokens"] == ours_chat["usage"]["prompt_tokens"]
    assert chat_got["usage"]["completion_tokens"] == 8
    status, chunks = post(stack.sglang.url + "/v1/chat/completions", chat | {"stream": True})
    assert status == 200 and chunks[0]["choices"][0]["delta"]["role"] == "assistant", chunks
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == chat_got["choices"][0]["message"][
        "content"]
    # token ids in, and a stop string: the text is cut before it as our router cuts it
    ids = got["output_ids"][:3]
    want = wants[PROMPTS[0]]
    stop = want[len(want) // 2: len(want) // 2 + 2]  # a string the greedy output holds
    _, ours = post(stack.ours.url + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                                                        "stop": [stop], "ignore_eos": True})
    _, got = post(stack.sglang.url + "/generate", {"text": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "stop": stop, "ignore_eos": True}})
    assert got["text"] == ours["choices"][0]["text"] and got["meta_info"]["finish_reason"]["type"] == "stop"
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, by_ids = post(stack.sglang.url + "/generate", {"input_ids": ids, "sampling_params": sp})
    _, ours = post(stack.ours.url + "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                        "ignore_eos": True})
    assert status == 200 and len(by_ids["output_ids"]) == 4, by_ids
    assert by_ids["text"] == ours["choices"][0]["text"]
    stack.prefill.wait_pools_free()
    stack.decode.wait_pools_free()


def wait_decoding(node: Node, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while node.load().ranks[0].running != 1:
        assert time.monotonic() < deadline, "the request never started decoding"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_both_nodes(stack: Stack, stream: bool) -> None:
    """Streaming: the node sees the disconnect on its next write; whole responses: the handler is cancelled."""
    rid = f"gone-{stream}-{time.monotonic_ns()}"
    body = {"text": "hello", "rid": rid, "stream": stream,
            "sampling_params": {"max_new_tokens": 1900, "temperature": 0, "ignore_eos": True}}
    conn = http.client.HTTPConnection("127.0.0.1", stack.sglang.port, timeout=60)
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        seen = b""
        while seen.count(b"data: ") < 3:
            chunk = resp.read1(65536)
            assert chunk, seen
            seen += chunk
    wait_decoding(stack.decode)  # 1900 tokens take far longer than the rest of this test
    assert conn.sock is not None
    conn.sock.close()  # the client goes away mid-request
    conn.close()
    stack.decode.wait_pools_free(timeout=30)
    stack.prefill.wait_pools_free(timeout=30)
    ended = [line for line in stack.decode.log().splitlines() if f"rid={rid}@" in line and "output tokens" in line]
    assert ended and ": abort," in ended[-1], ended  # aborted on the node, not run to its 1900 tokens


def test_worker_api_probes_and_bad_input(stack: Stack) -> None:
    p, d = f"http://127.0.0.1:{stack.prefill_http}", f"http://127.0.0.1:{stack.decode_http}"
    for base, mode in ((p, "prefill"), (d, "decode")):
        with urllib.request.urlopen(base + "/health", timeout=10) as resp:
            assert resp.status == 200
        with urllib.request.urlopen(base + "/health_generate", timeout=10) as resp:
            assert resp.status == 200
        for path in ("/server_info", "/get_server_info"):
            info = get(base + path)
            assert info["disaggregation_mode"] == mode and info["page_size"] > 0
        assert get(p + "/get_server_info")["disaggregation_bootstrap_port"] == stack.prefill.bootstrap_port
        assert get(base + "/get_model_info")["is_generation"] is True
        assert get(base + "/v1/models")["data"][0]["id"]
    bad = [
        (d, {"text": "x", "sampling_params": {"max_new_tokens": 4}}),  # no bootstrap_room
        (d, {"text": "x", "bootstrap_room": 7, "bootstrap_port": 1}),  # no bootstrap_host
        (p, {"text": "x", "bootstrap_room": 7, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1}),  # not P's port
        (p, {"text": "x", "bootstrap_room": 7, "sampling_params": {"temperature": -1}}),
        (p, {"text": "x", "bootstrap_room": 7, "sampling_params": {"max_tokens": 4}}),  # OpenAI's name, not SGLang's
        (p, {"text": ["a", "b"], "bootstrap_room": 7}),
        (p, {"text": "x", "input_ids": [1], "bootstrap_room": 7}),
        (p, {"input_ids": [10**9], "bootstrap_room": 7}),
        (p, {"text": "x", "bootstrap_room": -1}),
    ]
    for base, body in bad:
        status, err = post(base + "/generate", body)
        assert status == 400 and err["error"]["message"], (body, err)
    status, err = post(stack.sglang.url + "/generate", {"text": "x", "sampling_params": {"temperature": -1}})
    assert status == 400 and "temperature" in json.dumps(err), err  # through the router: the prefill's 400
    stack.prefill.wait_pools_free()
    stack.decode.wait_pools_free()
