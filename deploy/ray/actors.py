"""The Ray actors of a deployment. Each serving actor owns one real ``pdcluster`` process (a child that dies with
the actor) and exits when that process dies, so Ray's ``max_restarts`` replaces it.

    WorkerRegistry (named, detached)  <- NodeActor.register every REGISTER_PERIOD_S (entries expire after TTL)
          |  snapshot()
          v
    RouterActor: its sync thread reconciles the snapshot into its router via RegisterWorker / DeregisterWorker
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

import ray

from common import env
from common.wire.security import generate_cluster_token
from deploy.process import ManagedProcess, grpc_serving
from deploy.registrar import RouterRegistrar, WorkerInfo

logger = logging.getLogger(__name__)

REGISTRY_NAME = "pdcluster-registry"
REGISTER_PERIOD_S = 1.0
ENTRY_TTL_S = 10.0
SYNC_PERIOD_S = 0.5


@ray.remote(num_cpus=0)
class WorkerRegistry:
    """Serving nodes announce themselves here; routers read it. Entries expire unless refreshed."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[dict[str, object], float]] = {}
        self._secret = env.cluster_token() or generate_cluster_token()  # one per deployment, kept across `ray up`

    def cluster_secret(self) -> str:
        """The deployment's cluster secret, handed to every node and router actor through its runtime env."""
        return self._secret

    def register(self, info: dict[str, object]) -> None:
        self._entries[str(info["address"])] = (info, time.monotonic())

    def deregister(self, address: str) -> bool:
        return self._entries.pop(address, None) is not None

    def snapshot(self) -> list[dict[str, object]]:
        now = time.monotonic()
        self._entries = {a: e for a, e in self._entries.items() if now - e[1] < ENTRY_TTL_S}
        return [info for info, _ in self._entries.values()]


def _log_dir() -> Path:
    return Path(os.environ.get("PDCLUSTER_RAY_LOG_DIR", "/tmp/pdcluster-ray"))


def _exit_when_dead(proc: ManagedProcess, stopping: threading.Event, what: str) -> None:
    while not stopping.wait(0.5):
        if not proc.alive():
            logger.error("%s exited with %s; the actor exits so Ray restarts it", what, proc.proc.returncode)
            os._exit(1)


class _ProcessActor:
    """Shared by the node and router actors: one child process, health, shutdown."""

    proc: ManagedProcess
    address: str

    def _watch(self, what: str) -> None:
        self._stopping = threading.Event()
        threading.Thread(target=_exit_when_dead, args=(self.proc, self._stopping, what), daemon=True).start()

    def check_health(self) -> None:
        """Raises unless the process is alive and its gRPC health answers SERVING."""
        if not self.proc.alive():
            raise RuntimeError(f"{self.address}: process exited with {self.proc.proc.returncode}")
        if not grpc_serving(self.address):
            raise RuntimeError(f"{self.address}: gRPC health is not SERVING")

    def info(self) -> dict[str, object]:
        ctx = ray.get_runtime_context()
        return {"address": self.address, "pid": self.proc.pid, "node_id": ctx.get_node_id(),
                "argv": self.proc.argv[3:], "log": str(self.proc.log_path)}


@ray.remote(max_restarts=-1, max_task_retries=0)
class RankSlot:
    """Holds one bundle of a node's placement group for one of its rank processes (rank >= 1): while it lives,
    Ray gives the bundle's CPUs and GPUs to nobody else. The node actor runs the rank on ``placement()``'s GPUs."""

    def placement(self) -> dict[str, object]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}


def rank_devices_env(own_gpu_ids: list[str], slots: list[dict[str, object]], node_id: str) -> dict[str, str]:
    """The node process's ``CUDA_VISIBLE_DEVICES``: bundle 0's GPUs (the actor's own) then each slot's, in rank
    order, so rank r's ``cuda:r`` (``--base-gpu-id 0``) is bundle r's GPU. Empty without GPUs. Every slot must be
    on this machine (the group is STRICT_PACK)."""
    elsewhere = [s for s in slots if s["node_id"] != node_id]
    if elsewhere:
        raise RuntimeError(f"rank slots {elsewhere} are not on this node {node_id}: the group must be STRICT_PACK")
    gpus = [*own_gpu_ids, *(str(g) for s in slots for g in s["gpu_ids"])]  # type: ignore[attr-defined]
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {}


@ray.remote(max_restarts=-1, max_task_retries=0)
class NodeActor(_ProcessActor):
    """One prefill or decode node: ``pdcluster serve`` on the Ray node's IP and this replica's ports. Its rank
    processes beyond rank 0 use the bundles the ``slots`` (``RankSlot.placement()`` answers) hold."""

    def __init__(self, role: str, argv: list[str], port: int, bootstrap_port: int | None, registry_name: str,
                 namespace: str, start_timeout: float = 300.0, metrics_port: int | None = None,
                 slots: list[dict[str, object]] | None = None) -> None:
        host = ray.util.get_node_ip_address()
        self.role = role
        self.address = f"{host}:{port}"
        self.liveness_url = f"http://{host}:{metrics_port}/liveness" if metrics_port is not None else None
        self.worker = WorkerInfo(self.address, role, bootstrap_port)
        self.registry = ray.get_actor(registry_name, namespace=namespace)
        argv = [a.replace("{host}", host) for a in argv]
        env = rank_devices_env([str(g) for g in ray.get_gpu_ids()], slots or [],
                               ray.get_runtime_context().get_node_id())
        self.proc = ManagedProcess(argv, _log_dir() / f"{role}-{host}-{port}.log", env)
        self.proc.wait_serving(self.address, start_timeout)
        self._watch(f"{role} node {self.address}")
        self._registered = True
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stopping.is_set():
            if self._registered:
                try:
                    ray.get(self.registry.register.remote(asdict(self.worker)), timeout=5)
                except (ray.exceptions.RayError, TimeoutError) as e:
                    logger.warning("registry unreachable: %s", e)
            self._stopping.wait(REGISTER_PERIOD_S)

    def check_liveness(self, timeout: float = 5.0) -> None:
        """Raises unless the process lives and its ``/liveness`` answers 200 (no scheduler rank hung)."""
        if not self.proc.alive():
            raise RuntimeError(f"{self.address}: process exited with {self.proc.proc.returncode}")
        if self.liveness_url is None:
            return
        try:
            with urllib.request.urlopen(self.liveness_url, timeout=timeout):
                return
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.address}: {e.read().decode(errors='replace')}") from None
        except OSError as e:
            raise RuntimeError(f"{self.address}: /liveness unreachable: {e}") from None

    def shutdown(self, grace: float = 30.0) -> int | None:
        """Graceful drain: leave the registry (routers stop sending within a sync period), then SIGTERM."""
        self._registered = False
        ray.get(self.registry.deregister.remote(self.address))
        time.sleep(2 * SYNC_PERIOD_S)
        self._stopping.set()
        return self.proc.stop(grace)


@ray.remote(max_restarts=-1, max_task_retries=0)
class RouterActor(_ProcessActor):
    """``pdcluster router`` plus a thread that keeps its workers equal to the registry."""

    def __init__(self, argv: list[str], port: int, http_port: int, registry_name: str, namespace: str,
                 start_timeout: float = 120.0) -> None:
        host = ray.util.get_node_ip_address()
        self.address = f"{host}:{port}"
        self.http_url = f"http://{host}:{http_port}"
        self.registry = ray.get_actor(registry_name, namespace=namespace)
        argv = [a.replace("{host}", host) for a in argv]
        self.proc = ManagedProcess(argv, _log_dir() / f"router-{host}-{port}.log")
        self.proc.wait_serving(self.address, start_timeout)
        self._watch(f"router {self.address}")
        self.registrar = RouterRegistrar(self.address)
        threading.Thread(target=self._sync_forever, daemon=True).start()

    def _sync_forever(self) -> None:
        while not self._stopping.is_set():
            try:
                entries = ray.get(self.registry.snapshot.remote(), timeout=5)
                desired = [WorkerInfo(str(e["address"]), str(e["role"]), e.get("bootstrap_port"))  # type: ignore[arg-type]
                           for e in entries]
                added, removed = self.registrar.sync(desired)
                if added or removed:
                    logger.info("router workers: +%s -%s", added, removed)
            except (ray.exceptions.RayError, TimeoutError) as e:
                logger.warning("registry unreachable: %s", e)
            self._stopping.wait(SYNC_PERIOD_S)

    def workers(self) -> list[str]:
        return sorted(self.registrar.registered)

    def endpoints(self) -> dict[str, str]:
        return {"grpc": self.address, "http": self.http_url}

    def shutdown(self, grace: float = 10.0) -> int | None:
        self._stopping.set()
        self.registrar.close()
        return self.proc.stop(grace)
