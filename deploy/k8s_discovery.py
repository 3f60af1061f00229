"""Router discovery sidecar on Kubernetes: list the pods matching ``--selector`` through the API server every
``--interval`` seconds and reconcile the ready ones into the local router (``deploy.registrar``).

A pod is a worker when it is Ready, not terminating and not a non-leader pod of a LeaderWorkerSet group (no ``deletionTimestamp``): a pod being deleted is
deregistered at once, before its preStop hook ends and SIGTERM starts its drain. Its role is the
``pdcluster.io/role`` label; its address the pod IP with the container ports named ``grpc`` and ``bootstrap``.
Needs a ServiceAccount allowed to ``list`` pods (deploy/k8s/base/rbac.yaml).
"""

from __future__ import annotations

import argparse
import json
import logging
import ssl
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from deploy.registrar import RouterRegistrar, WorkerInfo

logger = logging.getLogger(__name__)
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ROLE_LABEL = "pdcluster.io/role"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on a group's leader


def pod_workers(pods: list[dict[str, Any]]) -> list[WorkerInfo]:
    """The workers among ``pods`` (items of a PodList)."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        labels = meta.get("labels", {})
        role = labels.get(ROLE_LABEL)
        if labels.get(LWS_WORKER_INDEX_LABEL, "0") != "0":
            continue  # a TP group's non-leader pod: its ranks are reached through the leader
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
        if role not in ("prefill", "decode") or not ready or meta.get("deletionTimestamp") or not status.get("podIP"):
            continue
        ports = {p.get("name"): p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        if "grpc" not in ports:
            continue
        out.append(WorkerInfo(f"{status['podIP']}:{ports['grpc']}", role, ports.get("bootstrap") if role == "prefill" else None))
    return out


class PodLister:
    def __init__(self, api_server: str, namespace: str, selector: str, token_path: Path | None,
                 ca_path: Path | None) -> None:
        query = urllib.parse.urlencode({"labelSelector": selector})
        self.url = f"{api_server.rstrip('/')}/api/v1/namespaces/{namespace}/pods?{query}"
        self.token_path = token_path
        self.ssl = ssl.create_default_context(cafile=str(ca_path)) if ca_path and ca_path.exists() else None

    def list(self) -> list[dict[str, Any]]:
        headers = {"Accept": "application/json"}
        if self.token_path is not None and self.token_path.exists():
            headers["Authorization"] = f"Bearer {self.token_path.read_text().strip()}"  # re-read: tokens rotate
        req = urllib.request.Request(self.url, headers=headers)
        with urllib.request.urlopen(req, timeout=10, context=self.ssl) as resp:
            return json.loads(resp.read())["items"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy.k8s_discovery", description=__doc__.splitlines()[0])
    p.add_argument("--router", required=True, help="the local router's gRPC address (host:port)")
    p.add_argument("--namespace", required=True)
    p.add_argument("--selector", required=True, help="label selector of the prefill and decode pods")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between pod lists")
    p.add_argument("--api-server", default="https://kubernetes.default.svc")
    p.add_argument("--token-path", default=str(SA_DIR / "token"))
    p.add_argument("--ca-path", default=str(SA_DIR / "ca.crt"))
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    lister = PodLister(ns.api_server, ns.namespace, ns.selector, Path(ns.token_path), Path(ns.ca_path))
    registrar = RouterRegistrar(ns.router)
    while True:
        try:
            added, removed = registrar.sync(pod_workers(lister.list()))
            if added or removed:
                logger.info("workers: +%s -%s", added, removed)
        except (OSError, ValueError, KeyError) as e:  # API server unreachable or odd answer: try again next tick
            logger.warning("pod list failed: %s", e)
        time.sleep(ns.interval)


if __name__ == "__main__":
    sys.exit(main())
