"""Kubernetes: every router and node container reads the cluster secret from the operator-created Secret, and no
overlay ships a Secret object (a committed value would be a public default)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from deploy.manifests import OVERLAYS, pod_templates, render

CLUSTER_SECRET = "pdcluster-cluster-secret"


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
