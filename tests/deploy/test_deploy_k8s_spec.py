"""Every rendered overlay carries exactly what the cluster spec says, per role: the image of its device (LWS
included), GPUs, Guaranteed QoS (requests == limits in every container), a /dev/shm inside the memory limit, the
device flags, container and Service ports, replicas and grace periods. Plus the spec's own refusals and the
Dockerfile's build rules (parsed: there is no Docker daemon here)."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

import pytest

from common.errors import ConfigError
from deploy import manifests
from deploy.k8s_spec import GPU_RESOURCE, object_name
from deploy.manifests import OVERLAYS, pod_templates, render
from deploy.spec import NODE_ROLES, PRESTOP_S, ROLES, Resources, load_spec, quantity_bytes
from tests.deploy.test_deploy_k8s import _parse

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


@functools.cache
def rendered(overlay: str) -> list[dict[str, Any]]:
    return render(overlay)


def _templates(overlay: str) -> list[tuple[str, manifests.PodTemplate]]:
    return [(t.labels["pdcluster.io/role"], t) for t in pod_templates(rendered(overlay))]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_follow_the_device_of_the_spec(overlay: str) -> None:
    spec = load_spec(profile=overlay)
    seen = set()
    for role, t in _templates(overlay):
        seen.add((role, t.owner.split("/")[0]))
        for c in t.spec["containers"]:
            assert c["image"] == spec.image(role), f"{t.owner}/{c['name']}: {c['image']}"
    if spec.device == "cuda":
        assert all(spec.image(r) == spec.images["cuda"] for r in NODE_ROLES)
        assert spec.images["cuda"] != spec.images["cpu"]
    if overlay == "gpu-multinode":  # the LeaderWorkerSets are reached by the image too
        assert {("prefill", "LeaderWorkerSet"), ("decode", "LeaderWorkerSet")} <= seen


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_guaranteed_qos_gpus_and_shm_per_role(overlay: str) -> None:
    spec = load_spec(profile=overlay)
    for role, t in _templates(overlay):
        for c in t.spec["containers"]:
            res = c["resources"]
            assert res["requests"] == res["limits"], f"{t.owner}/{c['name']}: requests != limits"
            assert {"cpu", "memory"} <= set(res["limits"]), f"{t.owner}/{c['name']}: not Guaranteed"
        main = t.spec["containers"][0]["resources"]["limits"]
        want = spec.role(role).resources
        assert (main["cpu"], main["memory"]) == (want.cpu, want.memory), t.owner
        if role == "router":
            assert GPU_RESOURCE not in main
            continue
        assert main.get(GPU_RESOURCE) == (str(spec.gpus(role)) if spec.gpus(role) else None), t.owner
        if spec.device == "cuda":
            assert int(main[GPU_RESOURCE]) >= 1, f"{t.owner}: a cuda pod without a GPU"
        shm = next(v for v in t.spec["volumes"] if v["name"] == "dshm")["emptyDir"]
        assert shm == {"medium": "Memory", "sizeLimit": want.shm}, t.owner
        assert quantity_bytes(shm["sizeLimit"]) < quantity_bytes(main["memory"]), f"{t.owner}: /dev/shm >= memory"
        mounts = {m["mountPath"]: m["name"] for m in t.spec["containers"][0]["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_device_flags_ports_replicas_and_grace_per_role(overlay: str) -> None:
    docs = rendered(overlay)
    spec = load_spec(profile=overlay)
    for role, t in _templates(overlay):
        c = t.spec["containers"][0]
        ns = _parse(c, docs, t.injected_env)
        p = spec.ports(role)
        assert t.spec["terminationGracePeriodSeconds"] == spec.grace_period(role), t.owner
        if role == "router":
            assert (ns.grpc_port, ns.http_port) == (p.grpc, p.http)
            sidecar = _parse(t.spec["containers"][1], docs)
            assert sidecar.router == f"127.0.0.1:{p.grpc}"
            # SIGTERM after the preStop; the drain and its abort RPCs end before the kubelet's SIGKILL.
            assert ns.drain_timeout_s == float(spec.router_flags()["drain-timeout"]) > 0
            assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_S)]
            assert t.spec["terminationGracePeriodSeconds"] >= PRESTOP_S + ns.drain_timeout_s + 5, t.owner
            continue
        assert (ns.device, ns.base_gpu_id) == (spec.device, int(spec.shared["base-gpu-id"])), t.owner
        assert ns.watchdog_timeout == float(spec.shared["watchdog-timeout"])
        assert (ns.tp_size, ns.nnodes) == (spec.role(role).tp, spec.role(role).nnodes), t.owner
        if ns.node_rank > 0:  # a TP group's worker pod: no Worker service, no probes (the leader's cover the group)
            assert c["ports"] == []
            assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(c), t.owner
            continue
        assert {p_["name"]: p_["containerPort"] for p_ in c["ports"]} == {
            k: v for k, v in (("grpc", p.grpc), ("bootstrap", p.bootstrap), ("metrics", p.metrics),
                              ("dist-init", p.dist_init), ("mux", p.mux)) if v is not None}
        assert ns.mux_port == p.mux, t.owner
        assert c["startupProbe"]["grpc"]["port"] == c["readinessProbe"]["grpc"]["port"] == p.grpc
        assert c["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "metrics"}
        assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_S)]
        assert t.spec["terminationGracePeriodSeconds"] >= PRESTOP_S + ns.drain_timeout + 10
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for role in ROLES:
        workload = by_kind.get(("Deployment", object_name(role))) or by_kind[("LeaderWorkerSet", object_name(role))]
        assert workload["spec"]["replicas"] == spec.role(role).replicas
        svc_ports = {sp["name"]: sp["port"] for sp in by_kind[("Service", object_name(role))]["spec"]["ports"]}
        assert svc_ports["grpc"] == spec.ports(role).grpc
        if role == "prefill":
            assert svc_ports["bootstrap"] == spec.ports(role).bootstrap
    hpa = by_kind[("HorizontalPodAutoscaler", object_name("router"))]["spec"]
    assert hpa["minReplicas"] == spec.role("router").replicas <= hpa["maxReplicas"]


def test_gpu_overlays_differ_from_cpu_dev_where_the_spec_does() -> None:
    cpu, gpu = load_spec(profile="cpu-dev"), load_spec(profile="gpu-single-node")
    assert (cpu.device, gpu.device) == ("cpu", "cuda")
    assert cpu.gpus("decode") == 0 and gpu.gpus("decode") == 1
    assert load_spec(profile="prod").grace_period("decode") == PRESTOP_S + 120 + 25


def test_spec_refuses_gpu_profile_without_gpus_and_shm_outside_memory() -> None:
    spec = load_spec(profile="gpu-single-node")
    with pytest.raises(ConfigError, match="gpus_per_rank is 0 but device is cuda"):
        spec.with_gpus_per_rank(0)
    with pytest.raises(ConfigError, match="must be 0 with device cpu"):
        load_spec(profile="cpu-dev").with_gpus_per_rank(1)
    decode = spec.role("decode")
    roles = {**spec.roles, "decode": dataclasses.replace(decode, resources=Resources("8", "16Gi", "16Gi", 1))}
    with pytest.raises(ConfigError, match="must be below its memory limit"):
        dataclasses.replace(spec, roles=roles)
    with pytest.raises(ConfigError, match="not a memory quantity"):
        quantity_bytes("lots")
    assert quantity_bytes("512Mi") == 512 << 20 and quantity_bytes("1G") == 10**9


# -- the Dockerfile -----------------------------------------------------------------------------------------------

def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_base_argument_stages_and_numeric_non_root_user() -> None:
    ins = _instructions()
    first_from = next(i for i, (w, _) in enumerate(ins) if w == "FROM")
    global_args = dict(a.split("=", 1) for w, a in ins[:first_from] if w == "ARG")
    assert global_args == {"BASE_IMAGE": "python:3.11-slim"}  # the CPU build is the default
    froms = [a for w, a in ins if w == "FROM"]
    assert len(froms) == 2 and all(f.split()[0] == "${BASE_IMAGE}" for f in froms), froms
    users = [a for w, a in ins if w == "USER"]
    assert len(users) == 1 and re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", users[0]), users  # numeric, not root
    assert ins[-1][0] == "CMD" and [w for w, _ in ins].index("USER") > [w for w, _ in ins].index("COPY")
    stage_args = dict(a.split("=", 1) for w, a in ins if w == "ARG" and "=" in a)
    assert stage_args["TORCH_SPEC"].strip('"') == "torch==2.13.0"
    assert stage_args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"


def test_dockerfile_documents_both_builds_and_exposes_the_spec_ports() -> None:
    text = DOCKERFILE.read_text()
    readme = (DOCKERFILE.parent / "deploy" / "README.md").read_text()
    spec = load_spec()
    cpu_tag, cuda_tag = spec.images["cpu"], spec.images["cuda"]
    # GPU: a CUDA 13 runtime base, because PyPI's torch==2.13.0 linux wheel requires cuda-toolkit==13.0.3.
    gpu_build = re.search(r"--build-arg BASE_IMAGE=nvidia/cuda:13\.\d+\.\d+-runtime-\S+ \\\s*\n[#\s]*"
                          r"--build-arg TORCH_INDEX=https://pypi\.org/simple -t (\S+) \.", text)
    assert gpu_build and gpu_build.group(1) == cuda_tag
    assert f"docker build -t {cpu_tag} ." in text
    assert f"docker build -t {cpu_tag} ." in readme and cuda_tag in readme and "nvidia/cuda:13." in readme
    exposed = {int(p) for w, a in _instructions() if w == "EXPOSE" for p in a.split()}
    want = {port for role in ROLES for port in vars(spec.ports(role)).values() if port is not None}
    assert exposed == want
