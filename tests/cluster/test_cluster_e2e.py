"""A whole local cluster (``pdcluster up``: router + 2 prefill + 1 decode node, real processes on 127.0.0.1)
driven through the official OpenAI client and the gRPC Router API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from common.ports import pick_free_port
from common.text.tokenizer import load_tokenizer
from common.wire.worker_auth import worker_channel
from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.node_helpers import Node

pytestmark = pytest.mark.slow

UP_TIMEOUT_S = 240


@dataclass
class Cluster:
    proc: subprocess.Popen[str]
    http_port: int
    grpc_port: int
    nodes: dict[str, str]  # name -> "127.0.0.1:port"
    pids: dict[str, int]
    log: Path
    metrics: dict[str, str]  # node name -> its /metrics URL (``up --metrics``)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def worker_stub(self, name: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(worker_channel(self.nodes[name]))


def start_up(model_path: Path, *extra: str) -> Cluster:
    http_port, grpc_port = pick_free_port(), pick_free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdcluster-up-test-{http_port}.log"
    cmd = [sys.executable, "-m", "common.app.cli", "up", "--model-path", str(model_path), "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), "--max-total-tokens", "4096", "--chunked-prefill-size", "64", *extra]
    out = open(log, "w")  # noqa: SIM115 - the child writes to it for its whole life
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text()
        if "pdcluster ready" in text:
            nodes, pids, metrics = {}, {}, {}
            for line in text.splitlines():
                parts = line.split()
                if len(parts) >= 5 and parts[1] == "pid" and parts[3] == "grpc":
                    nodes[parts[0]], pids[parts[0]] = parts[4], int(parts[2])
                    if len(parts) >= 7 and parts[5] == "metrics":
                        metrics[parts[0]] = parts[6]
            return Cluster(proc, http_port, grpc_port, nodes, pids, log, metrics)
        if proc.poll() is not None:
            raise RuntimeError(f"pdcluster up exited with {proc.returncode}:\n{text[-4000:]}")
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError(f"pdcluster up not ready in {UP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def stop_up(cluster: Cluster) -> None:
    if cluster.proc.poll() is None:
        cluster.proc.send_signal(signal.SIGINT)
        cluster.proc.wait(60)


@pytest.fixture(scope="module")
def cluster(model_path) -> Iterator[Cluster]:
    c = start_up(model_path, "--prefill", "2", "--decode", "1", "--metrics")
    yield c
    stop_up(c)
    assert c.proc.returncode == 0, c.log.read_text()[-3000:]
    assert "pdcluster stopped" in c.log.read_text()
    restarted = [int(line.split()[3]) for line in c.log.read_text().splitlines() if " restarted: pid " in line]
    for pid in [*c.pids.values(), *restarted]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # every child is gone, restarts too


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


def reference_ids(colocated: Node, ids: list[int], n: int) -> list[int]:
    sp = common_pb2.SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    out: list[int] = []
    for resp in colocated.stub.Generate(worker_pb2.GenerateRequest(rid=f"ref-{time.monotonic_ns()}", input_ids=ids,
                                                                   sampling_params=sp), timeout=60):
        out.extend(resp.chunk.token_ids if resp.HasField("chunk") else resp.finished.last.token_ids)
    return out


def wait_nodes_idle(cluster: Cluster, names: list[str], timeout: float = 30) -> None:
    """Every named node answers and is idle with its pools free (a node ``up`` just restarted may still be
    starting: it is waited for within ``timeout``)."""
    for name in names:
        stub = cluster.worker_stub(name)
        deadline = time.monotonic() + timeout
        while True:
            try:
                load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, f"{name}: {e}"
                time.sleep(0.5)
                continue
            r = load.ranks[0]
            if (r.free_kv_pages * load.page_size + r.evictable_tokens >= r.total_kv_pages * load.page_size
                    and r.running == r.waiting == r.bootstrap == r.inflight == r.prealloc == r.transfer == 0):
                break
            assert time.monotonic() < deadline, f"{name} did not return to idle: {load}"
            time.sleep(0.1)


def test_openai_completions_match_colocated(cluster, colocated, tokenizer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url, api_key="x", timeout=60)
    prompts = ["The quick brown fox", "Disaggregated serving moves KV caches " * 12, "a"]
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        want = tokenizer.decode(reference_ids(colocated, ids, 16), skip_special_tokens=True)
        resp = client.completions.create(model=Path(colocated_model(colocated)).name, prompt=prompt, max_tokens=16,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert resp.choices[0].text == want
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 16
        streamed = client.completions.create(model=resp.model, prompt=prompt, max_tokens=16, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True},
                                             stream_options={"include_usage": True})
        text, usage = "", None
        for chunk in streamed:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        assert text == want
        assert usage is not None and usage.completion_tokens == 16


def colocated_model(node: Node) -> str:
    return node.stub.GetServerInfo(worker_pb2.GetServerInfoRequest(), timeout=10).model_path


def test_openai_chat_and_cached_tokens(cluster, tokenizer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url, api_key="x", timeout=60)
    model = client.models.list().data[0].id
    system = "You are a terse assistant who answers about distributed systems. " * 6
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is a KV cache?"}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert first.choices[0].message.role == "assistant"
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 2, again.usage
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content


def test_grpc_router_generate_matches_colocated(cluster, colocated) -> None:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}"))
    ids = list(range(50, 170))
    want = reference_ids(colocated, ids, 12)
    sp = common_pb2.SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    req = router_pb2.RouterGenerateRequest(input_ids=router_pb2.TokenIds(ids=ids), sampling_params=sp, stream=True)
    complete = None
    streamed: list[int] = []
    for resp in stub.Generate(req, timeout=60):
        if resp.HasField("chunk"):
            streamed.extend(resp.chunk.token_ids)
        else:
            complete = resp.complete
    assert complete is not None and list(complete.output_ids) == want and streamed == want
    assert complete.usage.prompt_tokens == len(ids)
    assert complete.timing.transfer_bytes > 0 and complete.timing.ttft > 0


def test_concurrent_requests_all_succeed(cluster, colocated) -> None:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}"))
    prompts = [list(range(10 + i, 10 + i + 5 * (i + 1))) for i in range(16)]
    sp = common_pb2.SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)

    def run(ids: list[int]) -> list[int]:
        req = router_pb2.RouterGenerateRequest(input_ids=router_pb2.TokenIds(ids=ids), sampling_params=sp)
        return next(list(r.complete.output_ids) for r in stub.Generate(req, timeout=60) if r.HasField("complete"))

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(run, prompts))
    assert got == [reference_ids(colocated, p, 8) for p in prompts]


def test_client_cancel_frees_both_nodes(cluster) -> None:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}"))
    sp = common_pb2.SamplingParams(max_new_tokens=2000, temperature=0, ignore_eos=True)
    call = stub.Generate(router_pb2.RouterGenerateRequest(text="cancel me", sampling_params=sp, stream=True),
                         timeout=60)
    got = 0
    for resp in call:
        got += len(resp.chunk.token_ids)
        if got >= 3:
            call.cancel()
            break
    wait_nodes_idle(cluster, ["prefill-0", "prefill-1", "decode-0"])


def test_grpc_stream_carries_top_logprobs(cluster) -> None:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}"))
    sp = common_pb2.SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    req = router_pb2.RouterGenerateRequest(text="logprobs please", sampling_params=sp, stream=True,
                                           return_logprob=True, top_logprobs_num=3)
    tokens, tops = [], []
    for resp in stub.Generate(req, timeout=60):
        if resp.HasField("chunk"):
            assert len(resp.chunk.top_logprobs) == len(resp.chunk.token_ids) == len(resp.chunk.logprobs)
            tokens.extend(resp.chunk.token_ids)
            tops.extend(resp.chunk.top_logprobs)
        else:
            complete = resp.complete
    assert tokens == list(complete.output_ids) and len(tops) == 6
    for tok, top in zip(tokens, tops, strict=True):
        assert len(top.token_ids) == 3 and top.token_ids[0] == tok  # greedy: the chosen token is the most likely


def test_dashboard_names_only_exported_series(cluster) -> None:
    """After the traffic above, every series, label and function of the Grafana dashboard's PromQL exists in the
    scrapes of the router and of every node (tests/deploy/test_dashboard.py checks the dashboard offline)."""
    from deploy.dashboard import TARGET_LABELS, dashboard, expressions
    from deploy.promql import exported_series, unknown_names

    token = os.environ["PDCLUSTER_CLUSTER_TOKEN"]
    urls = [f"http://127.0.0.1:{cluster.http_port}/metrics", *cluster.metrics.values()]
    assert len(cluster.metrics) == 3, cluster.metrics
    text = "".join(urllib.request.urlopen(urllib.request.Request(u, headers={"Authorization": f"Bearer {token}"}),
                                          timeout=10).read().decode() for u in urls)
    series = exported_series(text)
    assert "pdcluster_node_queue_requests" in series and "pdcluster_router_ttft_seconds_bucket" in series
    assert unknown_names(list(expressions(dashboard())), series, TARGET_LABELS) == []


def _process_tree(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(p for c in children for p in _process_tree(int(c)))]


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # ended meanwhile
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="process CPU times from /proc")
def test_an_idle_cluster_sleeps(cluster) -> None:
    """After the traffic above, with nothing in flight, no process of the cluster spins: the router, the fronts, the
    ranks and their KV threads wait on their sockets and timers (a UCX loop thread once spun on a whole core per
    rank after its first transfer, for good)."""
    wait_nodes_idle(cluster, ["prefill-0", "prefill-1", "decode-0"])
    time.sleep(1.0)
    pids = _process_tree(cluster.proc.pid)
    before, t0 = {p: _cpu_s(p) for p in pids}, time.monotonic()
    time.sleep(3.0)
    used = {p: (_cpu_s(p) - before[p]) / (time.monotonic() - t0) for p in pids}
    assert sum(used.values()) < 0.5, {p: round(u, 2) for p, u in used.items() if u > 0.01}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to split")
def test_up_cpu_bind_auto_keeps_the_decode_rank_on_cores_of_its_own(model_path) -> None:
    """``up --cpu-bind auto``: the decode rank runs on cores no other process of the cluster uses (one here: its one
    torch thread, forwards inline), the router, the fronts and the prefill rank share the rest, and it serves."""
    from openai import OpenAI

    def cmdline(pid: int) -> str:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()

    c = start_up(model_path, "--cpu-bind", "auto")
    try:
        assert "CPU placement (--cpu-bind auto):" in c.log.read_text()
        ranks = [p for p in _process_tree(c.pids["decode-0"])[1:] if "resource_tracker" not in cmdline(p)]
        own = set().union(*(os.sched_getaffinity(p) for p in ranks))
        assert len(ranks) == 1 and own == {max(os.sched_getaffinity(0))}, (ranks, own)
        others = [p for p in _process_tree(c.proc.pid)[1:] if p not in ranks]  # up itself is left to the OS
        assert len(others) >= 4  # the router, 2 fronts, the prefill rank (and resource trackers)
        assert {p: os.sched_getaffinity(p) for p in others} == {p: os.sched_getaffinity(0) - own for p in others}
        client = OpenAI(base_url=c.base_url, api_key="x", timeout=60, max_retries=0)
        out = client.completions.create(model=client.models.list().data[0].id, prompt="The quick brown fox",
                                        max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8
    finally:
        stop_up(c)
    assert c.proc.returncode == 0, c.log.read_text()[-3000:]


RESTART_TIMEOUT_S = 120


def wait_restarted(cluster: Cluster, name: str, old_pid: int) -> int:
    """The new pid ``up`` reports for ``name`` after ``old_pid`` died (its exit line first, with the code)."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while time.monotonic() < deadline:
        text = cluster.log.read_text()
        if f"{name} (pid {old_pid}) exited with code -9" in text:
            for line in text.splitlines():
                if line.startswith(f"{name} restarted: pid "):
                    pid = int(line.split()[3])
                    if pid != old_pid and pid not in cluster.pids.values():
                        cluster.pids[name] = pid
                        return pid
        time.sleep(0.2)
    raise TimeoutError(f"up did not restart {name}:\n{cluster.log.read_text()[-3000:]}")


def complete_within(cluster: Cluster, timeout: float) -> int:
    """Seconds until a request through the router succeeds (each try bounded; errors while nodes come back)."""
    from openai import APIConnectionError, APIStatusError, OpenAI

    client = OpenAI(base_url=cluster.base_url, api_key="x", timeout=30, max_retries=0)
    start = time.monotonic()
    while True:
        try:
            model = client.models.list().data[0].id
            resp = client.completions.create(model=model, prompt="back again", max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert resp.usage.completion_tokens == 4
            return int(time.monotonic() - start)
        except (APIConnectionError, APIStatusError):
            assert time.monotonic() - start < timeout, cluster.log.read_text()[-3000:]
            time.sleep(0.5)


def test_up_restarts_a_killed_decode_node(cluster) -> None:
    old = cluster.pids["decode-0"]
    os.kill(old, signal.SIGKILL)
    new = wait_restarted(cluster, "decode-0", old)
    os.kill(new, 0)
    complete_within(cluster, 90)  # the router's monitor and the prefill nodes' KV peers find it again
    wait_nodes_idle(cluster, ["prefill-0", "prefill-1", "decode-0"])


def test_up_restarts_a_killed_router(cluster) -> None:
    old = cluster.pids["router"]
    os.kill(old, signal.SIGKILL)
    wait_restarted(cluster, "router", old)
    complete_within(cluster, 90)  # on its old ports
    assert cluster.proc.poll() is None  # up kept the nodes serving meanwhile
    wait_nodes_idle(cluster, ["prefill-0", "prefill-1", "decode-0"])


def test_prefill_killed_then_all_prefill_down(cluster) -> None:
    """Runs last in this module: it kills the prefill nodes (up restarts them; a node takes seconds to start)."""
    from openai import APIStatusError, OpenAI

    client = OpenAI(base_url=cluster.base_url, api_key="x", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    os.kill(cluster.pids["prefill-0"], signal.SIGKILL)
    for i in range(4):  # whatever the policy picks, the router retries on the surviving prefill node
        resp = client.completions.create(model=model, prompt=f"after the crash {i}", max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 4
    wait_restarted(cluster, "prefill-0", cluster.pids["prefill-0"])
    down = {name: cluster.pids[name] for name in ("prefill-0", "prefill-1")}
    for pid in down.values():  # both at once: a restart takes >= 1 s of backoff plus a node's start
        os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(APIStatusError) as exc:
        client.completions.create(model=model, prompt="nobody home", max_tokens=4)
    assert exc.value.status_code == 503
    assert time.monotonic() - start < 30
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/liveness", timeout=5) as r:
        assert r.status == 200  # the router itself keeps serving
    for name, pid in down.items():
        wait_restarted(cluster, name, pid)
    complete_within(cluster, 90)
    wait_nodes_idle(cluster, ["prefill-0", "prefill-1", "decode-0"], timeout=120)  # one may still be starting
