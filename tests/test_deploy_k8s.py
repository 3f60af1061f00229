"""Kubernetes manifests, offline: every overlay renders deterministically, passes strict schemas (built-in kinds for
two Kubernetes versions, custom resources against deploy/k8s/crds), its objects reference each other correctly, and
every container's command line parses with the real CLI parser to exactly the ports and flags of the cluster spec.
The tools come from the ``test`` extra; a missing tool fails these tests, never skips them."""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from common.app.cli import build_parser
from common.config import server_args_from_cli
from deploy import gen_k8s, k8s_discovery, manifests
from deploy.manifests import OVERLAYS, pod_templates, render, selector_matches
from deploy.spec import load_spec

K8S_VERSIONS = ("1.30.0", "1.37.0")
CRD_DIR = Path(manifests.__file__).with_name("k8s") / "crds"
CRD_SCHEMAS = {"LeaderWorkerSet": "leaderworkerset_v1.yaml", "ServiceMonitor": "servicemonitor_v1.yaml"}
PRESTOP_S = 5


@functools.cache
def rendered(overlay: str) -> list[dict[str, Any]]:
    return render(overlay)


def test_overlays_exist() -> None:
    assert {"cpu-dev", "gpu-single-node", "prod"} <= set(OVERLAYS)


def test_configmap_env_files_are_generated_from_the_spec() -> None:
    assert gen_k8s.main(["--check"]) == 0, "run: python -m deploy.gen_k8s"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renders_deterministically(overlay: str) -> None:
    assert render(overlay) == rendered(overlay)
    assert rendered(overlay), "empty render"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_objects_pass_strict_schemas(overlay: str, version: str) -> None:
    for doc in rendered(overlay):
        if doc["kind"] in CRD_SCHEMAS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)


def _strict_pod_template(template: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}, version, strict=True
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_pass_vendored_crd_schemas(overlay: str) -> None:
    for doc in rendered(overlay):
        if doc["kind"] not in CRD_SCHEMAS:  # built-in kinds: the test above (an unknown kind fails there)
            continue
        schema = yaml.safe_load((CRD_DIR / CRD_SCHEMAS[doc["kind"]]).read_text())
        jsonschema.Draft7Validator(schema).validate(doc)
        if doc["kind"] == "LeaderWorkerSet":
            for part in ("leaderTemplate", "workerTemplate"):
                for version in K8S_VERSIONS:
                    _strict_pod_template(doc["spec"]["leaderWorkerTemplate"][part], version)


def test_crd_schemas_reject_typos() -> None:
    schema = yaml.safe_load((CRD_DIR / "servicemonitor_v1.yaml").read_text())
    bad = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {},
           "spec": {"selector": {}, "endpoints": [{"prot": "metrics"}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(bad)


# -- cross-references -------------------------------------------------------------------------------------------

def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cross_references(overlay: str) -> None:
    docs = rendered(overlay)
    templates = list(pod_templates(docs))
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for d in _by_kind(docs, "Deployment"):
        assert selector_matches(d["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"]), d["metadata"]["name"]
    for svc in _by_kind(docs, "Service"):
        matched = [t for t in templates if selector_matches(svc["spec"]["selector"], t.labels)]
        assert matched, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            for t in matched:
                declared = {p for c in t.spec["containers"] for p in (*manifests.declared_ports(c), *manifests.declared_ports(c).values())}
                assert port["targetPort"] in declared, f"{svc['metadata']['name']}:{port['name']} -> {t.owner}"
    for pdb in _by_kind(docs, "PodDisruptionBudget"):
        assert any(selector_matches(pdb["spec"]["selector"], t.labels) for t in templates), pdb["metadata"]["name"]
    for hpa in _by_kind(docs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) in names, f"HPA targets missing {ref}"
    for sm in _by_kind(docs, "ServiceMonitor"):
        svcs = [s for s in _by_kind(docs, "Service") if selector_matches(sm["spec"]["selector"], s["metadata"].get("labels", {}))]
        assert svcs, "ServiceMonitor selects no Service"
        for ep in sm["spec"]["endpoints"]:
            assert any(ep["port"] in {p["name"] for p in s["spec"]["ports"]} for s in svcs)
    configmaps = {d["metadata"]["name"] for d in _by_kind(docs, "ConfigMap")}
    external_pvcs = {"pdcluster-model"}  # created by the operator of the cluster (deploy/README.md)
    for t in templates:
        if "serviceAccountName" in t.spec:
            assert ("ServiceAccount", t.spec["serviceAccountName"]) in names
        for c in t.spec["containers"]:
            for src in c.get("envFrom", []):
                assert src["configMapRef"]["name"] in configmaps, f"{t.owner}: missing ConfigMap"
            ports = manifests.declared_ports(c)
            assert len(ports) == len(c.get("ports", [])) and all(len(n) <= 15 for n in ports)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in c:
                    assert manifests.probe_port(c[kind], c) in ports.values(), f"{t.owner}/{c['name']} {kind} port"
                    if "grpc" in c[kind]:
                        assert isinstance(c[kind]["grpc"]["port"], int)
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in t.spec.get("volumes", [])}, f"{t.owner}: mount without a volume"
        for v in t.spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in external_pvcs
            if "emptyDir" in v and v["name"] == "dshm":
                assert v["emptyDir"]["medium"] == "Memory" and v["emptyDir"].get("sizeLimit")
    for rb in _by_kind(docs, "RoleBinding"):
        assert ("Role", rb["roleRef"]["name"]) in names
        assert all(("ServiceAccount", s["name"]) in names for s in rb["subjects"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_discovery_selects_exactly_the_node_pods(overlay: str) -> None:
    docs = rendered(overlay)
    router = next(t for t in pod_templates(docs) if t.labels.get("pdcluster.io/role") == "router")
    sidecar = next(c for c in router.spec["containers"] if c["name"] == "discovery")
    ns = k8s_discovery.build_parser().parse_args(manifests.expand(sidecar["args"], {"POD_NAMESPACE": "x"}))
    selector = manifests.parse_selector_string(ns.selector)
    selected = {t.labels.get("pdcluster.io/role") for t in pod_templates(docs) if selector_matches(selector, t.labels)}
    assert selected == {"prefill", "decode"}
    router_port = next(c for c in router.spec["containers"] if c["name"] == "router")["ports"][0]["containerPort"]
    assert ns.router == f"127.0.0.1:{router_port}"
    role = next(d for d in docs if d["kind"] == "Role")
    assert {"list"} <= set(role["rules"][0]["verbs"]) and "pods" in role["rules"][0]["resources"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_requests_equal_limits_and_cpu_dev_has_none(overlay: str) -> None:
    for t in pod_templates(rendered(overlay)):
        for c in t.spec["containers"]:
            res = c.get("resources", {})
            gpu_req, gpu_lim = res.get("requests", {}).get("nvidia.com/gpu"), res.get("limits", {}).get("nvidia.com/gpu")
            assert gpu_req == gpu_lim, f"{t.owner}: GPU requests != limits"
            if overlay == "cpu-dev":
                assert gpu_req is None
            elif t.labels.get("pdcluster.io/role") in ("prefill", "decode"):
                assert gpu_req is not None, f"{t.owner}: no GPU in a GPU overlay"


# -- the app contract: command lines -----------------------------------------------------------------------------

FIELDS = {"status.podIP": "10.0.0.7", "metadata.namespace": "pdcluster"}


def _parse(container: dict[str, Any], docs: list[dict[str, Any]],
           injected: dict[str, str] | None = None) -> argparse.Namespace:
    env = {**(injected or {}), **manifests.container_env(container, manifests.config_data(docs), FIELDS)}
    argv = manifests.expand(container["command"] + container["args"], env)
    if argv[:3] == ["python", "-m", "deploy.k8s_discovery"]:
        return k8s_discovery.build_parser().parse_args(argv[3:])
    assert argv[0] == "pdcluster", f"unexpected entry point {argv[0]}"
    return build_parser().parse_args(argv[1:])  # the real parser: an unknown flag exits (SystemExit)


def _spec_namespace(role: str, spec: Any, host: str, injected: dict[str, str]) -> argparse.Namespace:
    if role == "router":
        return build_parser().parse_args(spec.router_argv(host))
    rank = int(injected.get("LWS_WORKER_INDEX", 0))  # a LeaderWorkerSet pod: its group's rank and leader
    return build_parser().parse_args(spec.node_argv(role, host, node_rank=rank,
                                                    leader=injected.get("LWS_LEADER_ADDRESS")))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_command_lines_parse_and_agree_with_the_spec(overlay: str) -> None:
    docs = rendered(overlay)
    spec = load_spec(profile=overlay)
    seen = set()
    for t in pod_templates(docs):
        role = t.labels["pdcluster.io/role"]
        for c in t.spec["containers"]:
            ns = _parse(c, docs, t.injected_env)
            if c["name"] == "discovery":
                continue
            seen.add(role)
            host = "0.0.0.0" if role == "router" else FIELDS["status.podIP"]
            expected = _spec_namespace(role, spec, host, t.injected_env)
            assert vars(ns) == vars(expected), f"{t.owner}: flags differ from the cluster spec ({overlay})"
            ports = manifests.declared_ports(c)
            p = spec.ports(role)
            if role != "router" and ns.node_rank > 0:  # a group's worker pod: no Worker, Bootstrap or metrics
                assert ports == {}, t.owner
                assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(c), t.owner
                continue
            if role == "router":
                assert (ns.grpc_port, ns.http_port) == (ports["grpc"], ports["http"]) == (p.grpc, p.http)
            else:
                assert (ns.port, ns.metrics_port) == (ports["grpc"], ports["metrics"]) == (p.grpc, p.metrics)
                if role == "prefill":
                    assert ns.disaggregation_bootstrap_port == ports["bootstrap"] == p.bootstrap
                # Peers are told the pod IP (bootstrap, KV endpoints), never a wildcard bind address.
                assert server_args_from_cli(ns).advertised_host == FIELDS["status.podIP"], t.owner
                grace = t.spec["terminationGracePeriodSeconds"]
                assert grace >= ns.drain_timeout + PRESTOP_S + 10, f"{t.owner}: grace {grace}s < drain + preStop"
    assert seen == {"router", "prefill", "decode"}
    for d in docs:
        if d["kind"] in ("Deployment", "LeaderWorkerSet"):
            role = d["metadata"]["labels"]["pdcluster.io/role"]
            assert d["spec"].get("replicas", 1) == spec.role(role).replicas, f"{d['metadata']['name']} replicas"


def test_prod_pins_images() -> None:
    for t in pod_templates(rendered("prod")):
        for c in t.spec["containers"]:
            assert re.search(r":[\w.-]+$|@sha256:", c["image"]) and not c["image"].endswith(":latest")


# -- TP groups spanning pods (gpu-multinode) -------------------------------------------------------------------------

def test_multinode_lws_groups_span_pods_with_one_tp_group() -> None:
    """Each LeaderWorkerSet has size = the role's nnodes > 1; every pod's command line, through the node's own
    parser and ServerArgs checks, names the same rendezvous on the leader, its own node rank, and the spec's tp;
    its GPUs are its share of the group, and together the pods run exactly the group's tp ranks."""
    docs = rendered("gpu-multinode")
    spec = load_spec(profile="gpu-multinode")
    lws = {d["metadata"]["labels"]["pdcluster.io/role"]: d for d in docs if d["kind"] == "LeaderWorkerSet"}
    assert set(lws) == {"prefill", "decode"}
    assert not [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] != "pdcluster-router"]
    for role, d in lws.items():
        r = spec.role(role)
        size = d["spec"]["leaderWorkerTemplate"]["size"]
        assert size == r.nnodes > 1 and r.tp % size == 0, f"{role}: size {size}, spec {r}"
        ranks: list[int] = []
        leaders = set()
        for worker in range(size):  # every pod of group 0 (the worker template stands for indices 1..size-1)
            part = "leaderTemplate" if worker == 0 else "workerTemplate"
            template = d["spec"]["leaderWorkerTemplate"][part]
            container = template["spec"]["containers"][0]
            ns = _parse(container, docs, manifests.lws_pod_env(d, 0, worker))
            args = server_args_from_cli(ns)  # the node's own checks (nnodes, node rank, dist-init address)
            assert (args.tp_size, args.nnodes, args.node_rank, args.dp_size) == (r.tp, size, worker, 1)
            host, _, port = args.dist_init_addr.rpartition(":")
            assert host == f"{d['metadata']['name']}-0.{d['metadata']['name']}.{d['metadata']['namespace']}"
            assert int(port) == spec.ports(role).dist_init
            leaders.add(args.dist_init_addr)
            ranks += list(args.tp_ranks_here)
            gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
            assert gpus == len(args.tp_ranks_here) * r.resources.gpus_per_rank == spec.gpus(role)
        assert len(leaders) == 1 and ranks == list(range(r.tp)), f"{role}: ranks {ranks} over {leaders}"
        leader_ports = manifests.declared_ports(d["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0])
        assert leader_ports["dist-init"] == spec.ports(role).dist_init


def test_multinode_router_sees_only_group_leaders() -> None:
    docs = rendered("gpu-multinode")
    templates = list(pod_templates(docs))
    for svc in (d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] != "pdcluster-router"):
        picked = {t.owner.rsplit(":", 1)[-1] for t in templates if selector_matches(svc["spec"]["selector"], t.labels)}
        assert picked == {"leaderTemplate"}, f"{svc['metadata']['name']} selects {picked}"
        assert svc["spec"]["publishNotReadyAddresses"] is True  # the leader's name resolves while workers join
    pods = []
    for i, t in enumerate(t for t in templates if t.labels["pdcluster.io/role"] != "router"):
        pods.append({"metadata": {"labels": t.labels}, "spec": {"containers": t.spec["containers"]},
                     "status": {"podIP": f"10.0.0.{i}", "conditions": [{"type": "Ready", "status": "True"}]}})
    workers = k8s_discovery.pod_workers(pods)
    leaders = [p for p in pods if p["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"]
    assert len(pods) == 4 and sorted(w.address for w in workers) == sorted(
        f"{p['status']['podIP']}:{p['spec']['containers'][0]['ports'][0]['containerPort']}" for p in leaders)
