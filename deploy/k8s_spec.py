"""The cluster spec as Kubernetes patches: one kustomize Component per overlay (``<overlay>/spec/``, written by
``python -m deploy.gen_k8s``) that sets everything the spec decides on the hand-written base objects.

    per role (Deployment, or LeaderWorkerSet leader + worker)   replicas, terminationGracePeriodSeconds, image,
                                                                args (--flag=$(ENV) from the ConfigMap), ports,
                                                                probe ports, resources (requests == limits),
                                                                /dev/shm size (volume 0 of a node pod)
    Services                                                    ports
    HorizontalPodAutoscaler                                     minReplicas (the router's replicas)
    LeaderWorkerSet                                             size (the role's nnodes)

A role with nnodes > 1 exists only as a LeaderWorkerSet (components/multinode-lws): one group of nnodes pods per
replica, pod ``$(LWS_WORKER_INDEX)`` running node rank ``$(LWS_WORKER_INDEX)`` with ``--dist-init-addr`` on the leader
(``$(LWS_LEADER_ADDRESS)``, set by the LWS controller). Worker pods (``serve`` with ``--node-rank`` > 0) serve no
gRPC Worker, Bootstrap or metrics: they declare no ports (discovery skips them) and have no probes; a hung or dead worker rank stalls the group's collectives, so the
leader's ``/liveness`` fails and ``RecreateGroupOnPodRestart`` recreates the whole group.

The base YAML (deploy/k8s/base) holds only what the spec does not: probes' kinds and paths, lifecycle, env,
labels, RBAC. Overlays list ``spec`` first among their components so hardware components (rdma) add on top.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from deploy.spec import NODE_ROLES, ROLES, ClusterSpec

POD_PATHS = {
    "Deployment": ("/spec/template/spec",),
    "LeaderWorkerSet": ("/spec/leaderWorkerTemplate/leaderTemplate/spec",
                        "/spec/leaderWorkerTemplate/workerTemplate/spec"),
}
LEADER_POD, WORKER_POD = POD_PATHS["LeaderWorkerSet"]
LWS_LEADER_ADDRESS, LWS_WORKER_INDEX = "LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX"  # injected by the LWS controller
DISCOVERY_RESOURCES = {"cpu": "100m", "memory": "128Mi"}  # the router pod's discovery sidecar
GPU_RESOURCE = "nvidia.com/gpu"
HPA_MAX_ROUTERS = 4


def env_key(scope: str, flag: str) -> str:
    return f"{scope}_{flag}".upper().replace("-", "_")


def object_name(role: str) -> str:
    return f"pdcluster-{role}"


def _env_ref(spec: ClusterSpec, role: str, flag: str) -> str:
    if flag == "model-path":
        return "$(MODEL_PATH)"
    scope = role if role == "router" or flag in spec.role_flags(role) else "shared"
    return f"$({env_key(scope, flag)})"


def container_args(spec: ClusterSpec, role: str) -> list[str]:
    """The main container's args: listen flags literal (replica 0's ports), every spec flag from the ConfigMap; a
    role spanning nnodes > 1 pods adds its group's rendezvous and this pod's node rank from the LWS env."""
    p = spec.ports(role)
    if role == "router":
        args = ["router", "--host=0.0.0.0", f"--grpc-port={p.grpc}", f"--http-port={p.http}"]
        flags = spec.router_flags()
    else:
        args = ["serve", "--host=$(POD_IP)", f"--port={p.grpc}"]
        if p.bootstrap is not None:
            args.append(f"--disaggregation-bootstrap-port={p.bootstrap}")
        args += [f"--metrics-port={p.metrics}", f"--mux-port={p.mux}"]
        if p.dist_init is not None:
            args += [f"--dist-init-addr=$({LWS_LEADER_ADDRESS}):{p.dist_init}", f"--node-rank=$({LWS_WORKER_INDEX})"]
        flags = spec.node_flags(role)
    return args + [f"--{flag}={_env_ref(spec, role, flag)}" for flag in flags]


def container_ports(spec: ClusterSpec, role: str, leader: bool = True) -> list[dict[str, Any]]:
    """Named ports of a role's main container. Worker pods of a group (``leader=False``) serve nothing by name: their
    ranks only dial the leader's rendezvous and take gloo/NCCL connections on ephemeral ports."""
    p = spec.ports(role)
    named = {"grpc": p.grpc, "bootstrap": p.bootstrap, "metrics": p.metrics, "http": p.http,
             "mux": p.mux, "dist-init": p.dist_init}
    if not leader:
        return []
    return [{"name": n, "containerPort": port, "protocol": "TCP"} for n, port in named.items() if port is not None]


def service_ports(spec: ClusterSpec, role: str) -> list[dict[str, Any]]:
    p = spec.ports(role)
    if role == "router":
        return [{"name": "grpc", "port": p.grpc, "targetPort": "grpc", "appProtocol": "grpc"},
                {"name": "http", "port": 80, "targetPort": "http", "appProtocol": "http"},
                {"name": "metrics", "port": 9090, "targetPort": "http"}]
    ports = [{"name": "grpc", "port": p.grpc, "targetPort": "grpc", "appProtocol": "grpc"}]
    if p.bootstrap is not None:
        ports.append({"name": "bootstrap", "port": p.bootstrap, "targetPort": "bootstrap"})
    return [*ports, {"name": "metrics", "port": p.metrics, "targetPort": "metrics"}]


def resources(spec: ClusterSpec, role: str) -> dict[str, dict[str, str]]:
    """requests == limits (Guaranteed QoS), GPUs included."""
    res = spec.role(role).resources
    amounts = {"cpu": res.cpu, "memory": res.memory}
    if role in NODE_ROLES and spec.gpus(role):
        amounts[GPU_RESOURCE] = str(spec.gpus(role))
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _pod_ops(spec: ClusterSpec, role: str, pod: str) -> list[dict[str, Any]]:
    c0 = f"{pod}/containers/0"
    p = spec.ports(role)
    leader = pod != WORKER_POD
    ops = [
        {"op": "add", "path": f"{pod}/terminationGracePeriodSeconds", "value": spec.grace_period(role)},
        {"op": "add", "path": f"{c0}/image", "value": spec.image(role)},
        {"op": "add", "path": f"{c0}/args", "value": container_args(spec, role)},
        {"op": "add", "path": f"{c0}/ports", "value": container_ports(spec, role, leader)},
        {"op": "add", "path": f"{c0}/resources", "value": resources(spec, role)},
    ]
    if leader:
        ops.append({"op": "add", "path": f"{c0}/startupProbe/grpc/port", "value": p.grpc})
    if role == "router":
        c1 = f"{pod}/containers/1"
        ops += [
            {"op": "add", "path": f"{c1}/image", "value": spec.image(role)},
            {"op": "replace", "path": f"{c1}/args/0", "value": f"--router=127.0.0.1:{p.grpc}"},
            {"op": "add", "path": f"{c1}/resources",
             "value": {"requests": dict(DISCOVERY_RESOURCES), "limits": dict(DISCOVERY_RESOURCES)}},
        ]
    else:
        shm = spec.role(role).resources.shm
        if leader:
            ops.append({"op": "add", "path": f"{c0}/readinessProbe/grpc/port", "value": p.grpc})
        if shm is not None:
            ops.append({"op": "replace", "path": f"{pod}/volumes/0",  # NOTE: volume 0 of a node pod is dshm
                        "value": {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}})
    return ops


def component(spec: ClusterSpec) -> dict[str, Any]:
    """The kustomize Component of one spec (profile)."""
    patches = []
    for role in ROLES:
        kinds = ("Deployment",) if role == "router" else ("Deployment", "LeaderWorkerSet")
        if spec.role(role).nnodes > 1:  # a group of pods: only a LeaderWorkerSet can run it
            kinds = ("LeaderWorkerSet",)
        for kind in kinds:
            ops: list[dict[str, Any]] = [{"op": "add", "path": "/spec/replicas", "value": spec.role(role).replicas}]
            if kind == "LeaderWorkerSet":
                ops.append({"op": "replace", "path": "/spec/leaderWorkerTemplate/size", "value": spec.role(role).nnodes})
            for pod in POD_PATHS[kind]:
                ops += _pod_ops(spec, role, pod)
            patches.append({"target": {"kind": kind, "name": object_name(role)}, "patch": yaml.safe_dump(ops, sort_keys=False)})
        patches.append({"target": {"kind": "Service", "name": object_name(role)},
                        "patch": yaml.safe_dump([{"op": "add", "path": "/spec/ports",
                                                  "value": service_ports(spec, role)}], sort_keys=False)})
    routers = spec.role("router").replicas
    hpa = [{"op": "add", "path": "/spec/minReplicas", "value": routers},
           {"op": "add", "path": "/spec/maxReplicas", "value": max(HPA_MAX_ROUTERS, routers)}]
    patches.append({"target": {"kind": "HorizontalPodAutoscaler", "name": object_name("router")},
                    "patch": yaml.safe_dump(hpa, sort_keys=False)})
    return {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component", "patches": patches}


def leader_worker_set(deployment: dict[str, Any]) -> dict[str, Any]:
    """A node Deployment as a LeaderWorkerSet, one group per replica: the leader runs the Deployment's pod template,
    the workers the same without probes (they serve no gRPC Worker). Spec values (size, args, ports, resources)
    reach it through ``component``'s LeaderWorkerSet patches."""
    labels = {**deployment["metadata"]["labels"], "app.kubernetes.io/part-of": "pdcluster"}
    template = deployment["spec"]["template"]
    template = {"metadata": {"labels": {**template["metadata"]["labels"], "app.kubernetes.io/part-of": "pdcluster"}},
                "spec": template["spec"]}
    worker = copy.deepcopy(template)
    for c in worker["spec"]["containers"]:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            c.pop(probe, None)
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
        "metadata": {"name": deployment["metadata"]["name"], "labels": labels},
        "spec": {
            "replicas": 1, "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1}},
            "leaderWorkerTemplate": {"size": 1, "restartPolicy": "RecreateGroupOnPodRestart",
                                     "leaderTemplate": template, "workerTemplate": worker},
        },
    }
