"""Kubernetes: every router and node container reads the cluster secret from the operator-created Secret, and no
overlay ships a Secret object (a committed value would be a public default). Every pod runs as the image's non-root
UID without privileges on a read-only root; node pods carry no service-account token; NetworkPolicies admit exactly
clients -> router, router -> node gRPC, nodes <-> nodes (bootstrap, KV ports), Prometheus -> node metrics. Prometheus
scrapes the router's admin-guarded /metrics with the admin token from the Secret, and sends no token to nodes."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest

from deploy.manifests import (
    OVERLAYS,
    Peer,
    PodTemplate,
    ingress_allowed,
    pod_templates,
    render,
    selector_matches,
)
from deploy.spec import NODE_ROLES, load_spec

CLUSTER_SECRET = "pdcluster-cluster-secret"
DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"
ROLE_LABEL = "pdcluster.io/role"
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
KV_PORTS = range(32768, 65536)  # ephemeral ports of the KV control (ZeroMQ) and data listeners


@functools.cache
def rendered(overlay: str) -> list[dict[str, Any]]:
    return render(overlay)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_serving_container_gets_the_cluster_secret_from_a_secret(overlay: str) -> None:
    docs = rendered(overlay)
    serving = [(t, c) for t in pod_templates(docs) for c in t.spec["containers"] if c["name"] in ("router", "node", "discovery")]
    assert serving
    for t, c in serving:
        refs = [e["valueFrom"]["secretKeyRef"] for e in c.get("env", [])
                if e["name"] == "PDCLUSTER_CLUSTER_TOKEN" and "valueFrom" in e]
        assert refs == [{"name": CLUSTER_SECRET, "key": "token"}], f"{t.owner}/{c['name']}: {c.get('env')}"
        assert not any(e["name"] == "PDCLUSTER_CLUSTER_TOKEN" and "value" in e for e in c.get("env", []))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_value_is_committed(overlay: str) -> None:
    assert not [d for d in rendered(overlay) if d["kind"] == "Secret"]


def router_admin_token_ref(docs: list[dict[str, Any]]) -> dict[str, str]:
    """Where the router's admin token comes from: PDCLUSTER_ADMIN_TOKEN, else the cluster secret (router/guards/admin.py)."""
    (router,) = [c for t in pod_templates(docs) for c in t.spec["containers"] if c["name"] == "router"]
    assert not any(a.startswith("--admin-token") for a in (*router.get("command", []), *router.get("args", [])))
    env = {e["name"]: e for e in router.get("env", [])}
    source = env.get("PDCLUSTER_ADMIN_TOKEN") or env["PDCLUSTER_CLUSTER_TOKEN"]
    return source["valueFrom"]["secretKeyRef"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitors_send_the_admin_token_to_the_router_only(overlay: str) -> None:
    docs = rendered(overlay)
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitors or overlay != "prod", "prod ships the monitoring component"
    services = [d for d in docs if d["kind"] == "Service"]
    scraped: set[str] = set()
    for sm in monitors:
        roles = {s["metadata"]["labels"][ROLE_LABEL] for s in services
                 if selector_matches(sm["spec"]["selector"], s["metadata"].get("labels", {}))}
        assert roles and (roles == {"router"} or "router" not in roles), f"{sm['metadata']['name']} mixes {roles}"
        scraped |= roles
        for ep in sm["spec"]["endpoints"]:
            if roles == {"router"}:
                assert ep["bearerTokenSecret"] == router_admin_token_ref(docs), sm["metadata"]["name"]
            else:
                assert not {"bearerTokenSecret", "authorization", "basicAuth"} & ep.keys(), sm["metadata"]["name"]
    if monitors:
        assert scraped == {"router", *NODE_ROLES}


def image_uid() -> int:
    m = re.search(r"^USER (\d+):(\d+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert m and m.group(1) == m.group(2), "the Dockerfile's USER is a numeric uid:gid"
    return int(m.group(1))


def role(t: PodTemplate) -> str:
    return t.labels[ROLE_LABEL]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_the_image_uid_without_privileges_on_a_read_only_root(overlay: str) -> None:
    uid = image_uid()
    templates = list(pod_templates(rendered(overlay)))
    assert {role(t) for t in templates} == {"router", *NODE_ROLES}
    if overlay == "gpu-multinode":
        assert {t.owner.split("/")[0] for t in templates if role(t) != "router"} == {"LeaderWorkerSet"}
    for t in templates:
        pod = t.spec["securityContext"]
        assert pod["runAsNonRoot"] is True, t.owner
        assert (pod["runAsUser"], pod["runAsGroup"], pod["fsGroup"]) == (uid, uid, uid), t.owner
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, t.owner
        assert not t.spec.get("hostNetwork") and not t.spec.get("hostPID") and not t.spec.get("hostIPC"), t.owner
        empty_dirs = {v["name"] for v in t.spec.get("volumes", []) if "emptyDir" in v}
        for c in t.spec["containers"] + t.spec.get("initContainers", []):
            where = f"{t.owner}/{c['name']}"
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert not sc.get("privileged"), where
            assert sc.get("runAsUser", uid) == uid and sc.get("runAsNonRoot", True) is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            added = set(sc["capabilities"].get("add", []))
            wants_rdma = RDMA_RESOURCE in c.get("resources", {}).get("limits", {})
            assert added == ({"IPC_LOCK"} if wants_rdma else set()), f"{where}: adds {added}"
            writable = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            assert writable.get("/tmp") in empty_dirs, f"{where}: no writable /tmp on a read-only root"
            if c["name"] == "node":
                assert writable.get("/home/pdcluster") in empty_dirs, f"{where}: no writable $HOME (caches)"
                assert writable.get("/dev/shm") in empty_dirs, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_router_pod_mounts_a_service_account_token(overlay: str) -> None:
    for t in pod_templates(rendered(overlay)):
        if role(t) == "router":
            # The discovery sidecar lists pods with the router's account (deploy/k8s/base/rbac.yaml).
            assert t.spec["serviceAccountName"] == "pdcluster-router"
            assert t.spec.get("automountServiceAccountToken", True) is True
        else:
            assert t.spec["automountServiceAccountToken"] is False, t.owner
            assert t.spec.get("serviceAccountName", "default") == "default", t.owner


def _namespace(docs: list[dict[str, Any]]) -> str:
    return next(d["metadata"]["namespace"] for d in docs if d["kind"] == "Deployment")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_deny_ingress_by_default(overlay: str) -> None:
    docs = rendered(overlay)
    ns = _namespace(docs)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert all(d["metadata"]["namespace"] == ns for d in policies)
    deny = [d for d in policies if d["spec"]["podSelector"] == {} and not d["spec"].get("ingress")]
    assert [d["spec"]["policyTypes"] for d in deny] == [["Ingress"]], "one default-deny-ingress policy"
    # An unrelated pod of the namespace is isolated too: nothing reaches it.
    stranger = PodTemplate("Pod/other", {"app": "other"},
                           {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}]})
    assert not ingress_allowed(docs, Peer({}, {"kubernetes.io/metadata.name": ns}), stranger, 8080)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_exactly_the_cluster_flows(overlay: str) -> None:
    docs = rendered(overlay)
    spec = load_spec(profile=overlay)
    ns = _namespace(docs)
    here = {"kubernetes.io/metadata.name": ns}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    peers = {
        "client": Peer({"app": "client"}, {"kubernetes.io/metadata.name": "apps"}),
        "neighbour": Peer({"app": "other"}, here),
        "prometheus": Peer({"app.kubernetes.io/name": "prometheus"}, monitoring),
        "router": Peer({ROLE_LABEL: "router", "app.kubernetes.io/part-of": "pdcluster"}, here),
        **{r: Peer({ROLE_LABEL: r, "app.kubernetes.io/part-of": "pdcluster"}, here) for r in NODE_ROLES},
        "spoofed-node-elsewhere": Peer({ROLE_LABEL: "prefill"}, {"kubernetes.io/metadata.name": "apps"}),
    }
    spec_ports = {r: {p for p in vars(spec.ports(r)).values() if p is not None} for r in ("router", *NODE_ROLES)}
    for r, ports in spec_ports.items():
        assert not ports & set(KV_PORTS), f"{r}'s spec ports {ports} overlap the KV port range"
    probe_ports = set().union(*spec_ports.values()) | {22, 8080, 32767, KV_PORTS[0], 49152, KV_PORTS[-1]}

    def expected(src: str, dst: str, port: int, group_worker: bool) -> bool:
        p = spec.ports(dst)
        if dst == "router":
            return port in (p.grpc, p.http)
        if group_worker:  # a TP group's non-leader pod: only its ranks' gloo/NCCL ephemeral ports, from nodes
            return src in NODE_ROLES and port in KV_PORTS
        if src == "router":
            return port in (p.grpc, p.mux)
        if src in NODE_ROLES:
            return port in (p.bootstrap, p.dist_init) or port in KV_PORTS
        if src == "prometheus":
            return port == p.metrics
        return False

    templates = list(pod_templates(docs))
    assert templates
    for t in templates:
        dst = role(t)
        group_worker = t.labels.get("leaderworkerset.sigs.k8s.io/worker-index", "0") != "0"
        for src, peer in peers.items():
            for port in sorted(probe_ports):
                got = ingress_allowed(docs, peer, t, port)
                assert got == expected(src, dst, port, group_worker), f"{src} -> {t.owner}:{port}: admitted={got}"
