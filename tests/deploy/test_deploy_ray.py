"""``pdcluster ray``: the deployment on a real multi-node Ray cluster on 127.0.0.1 (head + a ``prefill`` node + a
``decode`` node, ``ray.cluster_utils.Cluster``), serving the tiny model through the real router and node processes.

One module-scoped cluster (10-15 s to start); the tests run in order: placement, a request, a node failure, a hung
node restarted by the liveness supervisor, down, then a tp 2 deployment on the same Ray cluster (one STRICT_PACK
placement group of 2 rank bundles per node, same greedy tokens).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from common.ports import LOWEST, ephemeral_range

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read by ray.cluster_utils; keeps every node on loopback

import grpc
import ray
from ray.cluster_utils import Cluster

from deploy.ray import deployer
from deploy.ray.actors import REGISTRY_NAME
from deploy.spec import load_spec
from pdcluster.v1 import router_pb2, router_pb2_grpc
from tests.model_fixtures import make_tiny_model
from tests.node_helpers import rank_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NAMESPACE = "pdcluster-test"
FAST_FAILURE = {  # the head notices a dead raylet in ~3 s instead of ~30 s
    "health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3,
    "health_check_initial_delay_ms": 1000,
}
WATCHDOG_S = 3.0
PROMPT = "The quick brown fox"
MAX_TOKENS = 8


def _free_bases(span: int = 12) -> dict[str, int]:
    """Port bases of the router, prefill and decode roles: 3 consecutive spans of ``span`` free ports (bases drawn
    one by one could land within a replica stride of each other, which the spec refuses)."""
    for _ in range(200):
        base = random.randrange(LOWEST, ephemeral_range()[0] - 3 * span)  # no port-0 bind can take them
        try:
            for port in range(base, base + 3 * span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return {"router": base, "prefill": base + span, "decode": base + 2 * span}
        except OSError:
            continue
    raise RuntimeError("no free port range")


def _add_role_node(cluster: Cluster, role: str) -> Any:
    return cluster.add_node(
        node_ip_address="127.0.0.1", num_cpus=1, resources={role: 1}, labels={"pdcluster.io/role": role},
        object_store_memory=75 << 20,
    )


HEAD_NODE = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "include_dashboard": False,
             "object_store_memory": 75 << 20, "_system_config": FAST_FAILURE}


def _start_cluster() -> tuple[Cluster, dict[str, Any]]:
    """The head and one node per role. A start that fails leaves no Ray process behind; it is tried twice, since Ray
    gives a starting raylet a fixed 30 s to register (``ray._private.node``), which a loaded 2-core machine has
    missed ("The current node timed out during startup", the head's GCS left running)."""
    for attempt in range(2):
        c = Cluster(initialize_head=False)
        try:
            c.add_node(**HEAD_NODE)
            nodes = {role: _add_role_node(c, role) for role in ("prefill", "decode")}
            c.wait_for_nodes()
            return c, nodes
        except Exception:
            c.shutdown()
            if attempt:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    c, nodes = _start_cluster()
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
    model = make_tiny_model("llama")
    spec = (
        load_spec()
        .with_port_bases(**_free_bases())
        .with_counts(prefill=1, decode=1, router=1)
        .with_flags(model_path=str(model), max_total_tokens=1024, torch_num_threads=1, drain_timeout=2,
                    max_running_requests=16, watchdog_timeout=WATCHDOG_S)
    )
    opts = deployer.RayOptions(namespace=NAMESPACE, node_cpus=0.5, start_timeout_s=180)
    try:
        out = deployer.up(spec, opts)
        yield {"cluster": c, "nodes": nodes, "spec": spec, "model": model, "router": out["routers"][0]}  # type: ignore[index]
    finally:
        try:
            deployer.down(NAMESPACE, grace=5)
        finally:
            ray.shutdown()
            c.shutdown()


def _complete(http_url: str, timeout: float = 60) -> dict[str, Any]:
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{http_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _generate_ids(grpc_addr: str) -> list[int]:
    with grpc.insecure_channel(grpc_addr) as ch:
        req = router_pb2.RouterGenerateRequest(text=PROMPT)
        req.sampling_params.max_new_tokens = MAX_TOKENS
        req.sampling_params.temperature = 0.0
        req.sampling_params.ignore_eos = True
        final = list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=60))[-1]
    return list(final.complete.output_ids)


def _colocated(model: Any) -> tuple[str, list[int]]:
    from common.node.engine import Engine

    with Engine(model_path=str(model), max_total_tokens=1024, max_running_requests=16) as engine:
        out = engine.generate(prompt=PROMPT, sampling_params={"max_new_tokens": MAX_TOKENS, "temperature": 0.0,
                                                               "ignore_eos": True})
    assert not isinstance(out, list)
    return out.text, list(out.output_ids)


def _actor_node(role: str) -> str:
    return str(ray.get(ray.get_actor(deployer.actor_name(role, 0), namespace=NAMESPACE).info.remote())["node_id"])


def test_actors_land_on_their_role_nodes(cluster: dict[str, Any]) -> None:
    for role, node in cluster["nodes"].items():
        assert _actor_node(role) == node.node_id, f"{role} actor is not on the {role} node"
    status = deployer.status(NAMESPACE)
    assert {n for n, s in status.items() if s["healthy"]} == {  # type: ignore[index]
        "pdcluster-router-0", "pdcluster-prefill-0", "pdcluster-decode-0"}
    spec = cluster["spec"]
    prefill = status["pdcluster-prefill-0"]["address"]  # type: ignore[index]
    decode = status["pdcluster-decode-0"]["address"]  # type: ignore[index]
    assert prefill == f"127.0.0.1:{spec.ports('prefill').grpc}" and decode == f"127.0.0.1:{spec.ports('decode').grpc}"


def test_request_through_router_matches_colocated(cluster: dict[str, Any]) -> None:
    router = cluster["router"]
    out = _complete(router["http"])
    ids = _generate_ids(router["grpc"])
    text, ref_ids = _colocated(cluster["model"])
    assert ids == ref_ids
    assert out["choices"][0]["text"] == text
    assert out["usage"]["completion_tokens"] == MAX_TOKENS


def test_decode_node_failure_restarts_actor_elsewhere(cluster: dict[str, Any]) -> None:
    c: Cluster = cluster["cluster"]
    old = cluster["nodes"]["decode"]
    c.remove_node(old, allow_graceful=False)
    new = _add_role_node(c, "decode")
    cluster["nodes"]["decode"] = new
    handle = ray.get_actor(deployer.actor_name("decode", 0), namespace=NAMESPACE)
    deadline = time.monotonic() + 150
    while True:
        try:
            ray.get(handle.check_health.remote(), timeout=10)
            break
        except (ray.exceptions.RayError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert _actor_node("decode") == new.node_id
    last: Exception | None = None
    while time.monotonic() < deadline:  # the router re-probes the restarted worker
        try:
            out = _complete(cluster["router"]["http"], timeout=30)
            assert out["usage"]["completion_tokens"] == MAX_TOKENS
            return
        except OSError as e:  # urllib's HTTPError (503 until the worker is healthy again) is an OSError
            last = e
            time.sleep(0.5)
    raise AssertionError(f"router did not serve again after the decode node was replaced: {last}")


def _wait_healthy(name: str, deadline: float) -> None:
    handle = ray.get_actor(name, namespace=NAMESPACE)
    while True:
        try:
            ray.get(handle.check_health.remote(), timeout=10)
            return
        except (ray.exceptions.RayError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_hung_node_is_restarted_by_the_liveness_supervisor(cluster: dict[str, Any]) -> None:
    name = deployer.actor_name("prefill", 0)
    old_pid = deployer.status(NAMESPACE)[name]["pid"]  # type: ignore[index]
    (rank,) = rank_pids(old_pid)
    tracker = deployer.LivenessTracker(failures_to_restart=2, restart_grace_s=120.0)

    def supervise() -> list[str]:
        return deployer.supervise_once([name], lambda n: deployer.probe_node(NAMESPACE, n, timeout=10),
                                       lambda n: deployer.restart_node(NAMESPACE, n), tracker)

    assert supervise() == []  # healthy: live
    os.kill(rank, signal.SIGSTOP)  # the node's engine hangs; its front and gRPC health stay up
    try:
        deadline = time.monotonic() + 60
        restarted: list[str] = []
        while not restarted and time.monotonic() < deadline:
            time.sleep(1.0)
            restarted = supervise()
        assert restarted == [name], "the supervisor did not restart the hung node"
    finally:
        if _pid_alive(rank):
            os.kill(rank, signal.SIGCONT)
    _wait_healthy(name, time.monotonic() + 150)
    assert deployer.status(NAMESPACE)[name]["pid"] != old_pid  # type: ignore[index]
    assert deployer.probe_node(NAMESPACE, name)
    deadline = time.monotonic() + 20
    while _pid_alive(rank) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pid_alive(rank), "the hung rank outlived its node"
    deadline = time.monotonic() + 60
    while True:  # the router serves through the restarted prefill node
        try:
            assert _complete(cluster["router"]["http"], timeout=30)["usage"]["completion_tokens"] == MAX_TOKENS
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_down_leaves_no_actors(cluster: dict[str, Any]) -> None:
    pids = [s["pid"] for s in deployer.status(NAMESPACE).values()]  # type: ignore[index]
    removed = deployer.down(NAMESPACE, grace=5)
    assert REGISTRY_NAME in removed and "pdcluster-router-0" in removed
    from ray.util import list_named_actors, placement_group_table

    assert [a for a in list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE] == []
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values()
               if pg.get("name", "").startswith("pdcluster-"))
    deadline = time.monotonic() + 15
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_pid_alive(p) for p in pids), "a node or router process outlived its actor"


@ray.remote(num_cpus=0)
class _BundleProbe:
    """Stands in for the node actor in bundle 0: what Ray gives it there."""

    def where(self) -> tuple[str, list[str]]:
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


def test_tp2_rank_bundles_hand_distinct_gpus_of_one_machine_to_the_node(cluster: dict[str, Any]) -> None:
    """On a machine with 2 (Ray-accounted) GPUs: the tp 2 plan's STRICT_PACK group puts both rank bundles there, the
    slot actor of bundle 1 gets the GPU bundle 0 does not, and the node's CUDA_VISIBLE_DEVICES lists both in order."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from deploy.ray.actors import RankSlot, rank_devices_env
    from deploy.ray.placement import plan_role

    c: Cluster = cluster["cluster"]
    gpu_node = c.add_node(node_ip_address="127.0.0.1", num_cpus=1, num_gpus=2, object_store_memory=75 << 20)
    c.wait_for_nodes()
    (group,), (place,) = plan_role("prefill", 1, 2, cpus_per_rank=0.25, gpus_per_rank=1, pin="none",
                                   prefix="pdcluster-gputest")
    pg = placement_group(group.bundles, strategy=group.strategy, name=group.name)  # type: ignore[arg-type]
    opts = deployer.RayOptions(namespace=NAMESPACE, pin="none")
    try:
        ray.get(pg.ready(), timeout=60)
        probe = _BundleProbe.options(**deployer._bundle_options(place, pg, place.bundle, opts)).remote()  # type: ignore[attr-defined]
        slots = [RankSlot.options(**deployer._bundle_options(place, pg, b, opts)).remote()  # type: ignore[attr-defined]
                 for b in place.rank_bundles]
        node_id, own = ray.get(probe.where.remote(), timeout=60)
        where = ray.get([s.placement.remote() for s in slots], timeout=60)
        assert node_id == gpu_node.node_id and len(own) == 1
        env = rank_devices_env(own, where, node_id)
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[0] == own[0] and sorted(visible) == ["0", "1"], env
        for actor in (probe, *slots):
            ray.kill(actor)
    finally:
        remove_placement_group(pg)
        c.remove_node(gpu_node)


def test_tp2_nodes_run_in_one_placement_group_each_with_the_same_greedy_tokens(cluster: dict[str, Any]) -> None:
    """End to end with tp 2 on both roles (needs the node's TP wiring): each node's 2 ranks hold the 2 bundles of
    its own STRICT_PACK group on its role's machine, and the router's greedy tokens equal the colocated engine's."""
    from ray.util import placement_group_table

    deployer.down(NAMESPACE, grace=5)  # the module's tp 1 deployment holds the role nodes' CPUs when run alone
    spec = cluster["spec"].with_port_bases(**_free_bases()).with_tp(
        prefill=2, decode=2)
    opts = deployer.RayOptions(namespace=NAMESPACE, node_cpus=0.5, start_timeout_s=180)
    try:
        out = deployer.up(spec, opts)
        groups = {pg["name"]: pg for pg in placement_group_table().values() if pg["state"] == "CREATED"}
        for role in ("prefill", "decode"):
            pg = groups[f"pdcluster-{role}-0"]
            assert pg["strategy"] == "STRICT_PACK" and len(pg["bundles"]) == 2, pg
            assert set(pg["bundles_to_node_id"].values()) == {cluster["nodes"][role].node_id}
            assert _actor_node(role) == cluster["nodes"][role].node_id
            slot = ray.get_actor(deployer.slot_name(role, 0, 1), namespace=NAMESPACE)
            assert ray.get(slot.placement.remote())["node_id"] == cluster["nodes"][role].node_id
            pid = deployer.status(NAMESPACE)[deployer.actor_name(role, 0)]["pid"]  # type: ignore[index]
            assert len(rank_pids(pid)) == 2, f"{role}: the node does not run 2 rank processes"
        _, ref_ids = _colocated(cluster["model"])
        assert _generate_ids(out["routers"][0]["grpc"]) == ref_ids  # type: ignore[index]
    finally:
        deployer.down(NAMESPACE, grace=5)
    assert not [pg for pg in placement_group_table().values()
                if pg.get("name", "").startswith("pdcluster-") and pg["state"] != "REMOVED"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
