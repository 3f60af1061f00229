"""The ``cpu-dev`` overlay's containers, started as real processes on 127.0.0.1 from their rendered command lines,
answer exactly the probes the manifests declare; discovery (the router sidecar's reconcile) makes the router ready;
a draining node fails readiness but stays live.

Stand-ins for the cluster: POD_IP = 127.0.0.1, each declared container port mapped to a free local port (in the
args and in the probes alike), the tiny test model appended as ``--model-path`` (the image bakes the default model).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.wire.worker_auth import worker_channel
from deploy import manifests
from deploy.k8s_discovery import pod_workers
from deploy.process import grpc_serving
from deploy.registrar import RouterRegistrar
from tests.model_fixtures import make_tiny_model
from tests.node_helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


class Pod:
    def __init__(self, role: str, container: dict[str, Any], docs: list[dict[str, Any]], model: Path) -> None:
        self.role = role
        self.portmap = {p: free_port() for p in manifests.declared_ports(container).values()}
        self.container = container
        env = manifests.container_env(container, manifests.config_data(docs), {"status.podIP": "127.0.0.1"})
        argv = manifests.expand(container["args"], env)
        argv = [self._remap(a) for a in argv] + [f"--model-path={model}", "--torch-num-threads=1"] * (role != "router")
        if role == "router":
            argv.append(f"--model-path={model}")
        self.log = Path(tempfile.mkstemp(prefix=f"pdcluster-k8s-{role}-", suffix=".log")[1])
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "common.app.cli", *argv], stdout=out, stderr=subprocess.STDOUT)

    def _remap(self, arg: str) -> str:
        flag, _, value = arg.partition("=")
        return f"{flag}={self.portmap[int(value)]}" if value.isdigit() and int(value) in self.portmap else arg

    def port(self, name: str) -> int:
        return self.portmap[manifests.declared_ports(self.container)[name]]

    def probe(self, kind: str) -> bool:
        """Run the manifest's probe once, like the kubelet (grpc: Health/Check(service) SERVING; httpGet: 2xx)."""
        p = self.container[kind]
        port = self.portmap[manifests.probe_port(p, self.container)]
        if "grpc" in p:
            return grpc_serving(f"127.0.0.1:{port}", timeout=1, service=p["grpc"].get("service", ""))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{p['httpGet']['path']}", timeout=2) as r:
                return 200 <= r.status < 400
        except (urllib.error.URLError, OSError):
            return False

    def wait(self, kind: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.probe(kind):
            assert self.proc.poll() is None, f"{self.role} exited:\n{self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.role} {kind} never passed:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.3)

    def pod_object(self) -> dict[str, Any]:
        """What the API server would list for this pod once Ready (for the discovery sidecar)."""
        ports = [{"name": n, "containerPort": self.portmap[p]} for n, p in manifests.declared_ports(self.container).items()]
        return {"metadata": {"labels": {"pdcluster.io/role": self.role}},
                "spec": {"containers": [{"name": "node", "ports": ports}]},
                "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def pods() -> Iterator[dict[str, Pod]]:
    docs = manifests.render("cpu-dev")
    model = make_tiny_model("llama")
    started: dict[str, Pod] = {}
    try:
        for t in manifests.pod_templates(docs):
            role = t.labels["pdcluster.io/role"]
            main = next(c for c in t.spec["containers"] if c["name"] in ("node", "router"))
            started[role] = Pod(role, main, docs, model)
        yield started
    finally:
        for pod in started.values():
            pod.stop()


def test_probes_answer_and_discovery_makes_the_router_ready(pods: dict[str, Pod]) -> None:
    for pod in pods.values():
        pod.wait("startupProbe")
    for role in ("prefill", "decode"):
        for kind in PROBES:
            assert pods[role].probe(kind), f"{role} {kind}"
    router = pods["router"]
    assert router.probe("livenessProbe") and router.probe("startupProbe")
    assert not router.probe("readinessProbe"), "a router without workers must not be ready"
    registrar = RouterRegistrar(f"127.0.0.1:{router.port('grpc')}")
    added, _ = registrar.sync(pod_workers([pods[r].pod_object() for r in ("prefill", "decode")]))
    assert len(added) == 2
    router.wait("readinessProbe", timeout=30)
    registrar.close()


def test_draining_node_fails_readiness_but_stays_live(pods: dict[str, Pod]) -> None:

    from pdcluster.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    decode = pods["decode"]
    decode.wait("readinessProbe")
    # A request in flight keeps the node draining: it waits for KV from a prefill node that does not exist.
    channel = worker_channel(f"127.0.0.1:{decode.port('grpc')}")
    pending = worker_pb2_grpc.WorkerStub(channel).Decode(worker_pb2.DecodeRequest(
        request=worker_pb2.GenerateRequest(rid="drain-probe", input_ids=[5, 6, 7],
                                           sampling_params=common_pb2.SamplingParams(max_new_tokens=2)),
        bootstrap_room=1, bootstrap_addr="127.0.0.1:1"), timeout=60)
    time.sleep(1.0)  # the request reaches the node
    decode.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while decode.probe("readinessProbe"):
        assert time.monotonic() < deadline, "readiness still SERVING after SIGTERM"
        time.sleep(0.05)
    assert decode.proc.poll() is None, "the node must keep draining while a request is in flight"
    assert decode.probe("livenessProbe"), "liveness must stay green while the node drains"
    pending.cancel()
    channel.close()
    assert decode.proc.wait(40) == 0
