"""Worker discovery, the part every platform shares: a desired set of workers (from the Ray registry actor, or from
the Kubernetes pod list) is reconciled into a router through its gRPC ``RegisterWorker`` / ``DeregisterWorker`` API
- the same calls any operator can make by hand, so discovery works the same on Ray, Kubernetes and elsewhere."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from common import env
from pdcluster.v1 import router_pb2, router_pb2_grpc
from router.guards.admin import bearer_metadata

logger = logging.getLogger(__name__)

PB_ROLE = {
    "prefill": router_pb2.WORKER_ROLE_PREFILL,
    "decode": router_pb2.WORKER_ROLE_DECODE,
    "colocated": router_pb2.WORKER_ROLE_COLOCATED,
}


@dataclass(frozen=True)
class WorkerInfo:
    """One serving node as discovery sees it."""

    address: str  # host:port of its Worker gRPC service
    role: str  # prefill | decode | colocated
    bootstrap_port: int | None = None  # prefill only


class RouterRegistrar:
    """Keeps one router's runtime worker set equal to the desired set. Not thread-safe; one caller loop."""

    def __init__(self, router_address: str, rpc_timeout: float = 5.0) -> None:
        self.router_address = router_address
        self.rpc_timeout = rpc_timeout
        self._channel = grpc.insecure_channel(router_address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._auth = bearer_metadata(env.admin_token())  # the router's admin credential (router/guards/admin.py)
        self.registered: dict[str, WorkerInfo] = {}

    def register(self, w: WorkerInfo) -> None:
        self._stub.RegisterWorker(
            router_pb2.RegisterWorkerRequest(address=w.address, role=PB_ROLE[w.role], bootstrap_port=w.bootstrap_port or 0),
            timeout=self.rpc_timeout, metadata=self._auth,
        )
        self.registered[w.address] = w

    def deregister(self, address: str) -> bool:
        resp = self._stub.DeregisterWorker(
            router_pb2.DeregisterWorkerRequest(address=address), timeout=self.rpc_timeout, metadata=self._auth
        )
        self.registered.pop(address, None)
        return resp.found

    def sync(self, desired: list[WorkerInfo]) -> tuple[list[str], list[str]]:
        """Register what is new or changed, deregister what is gone. Returns (added, removed) addresses.

        RPC failures are logged and retried by the next ``sync`` (the router may be restarting)."""
        want = {w.address: w for w in desired}
        added, removed = [], []
        try:  # a restarted router has forgotten runtime registrations: ask it what it has
            known = {w.address for w in self._stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=self.rpc_timeout, metadata=self._auth).workers}
        except grpc.RpcError as e:
            logger.warning("router %s unreachable: %s", self.router_address, e.code())
            return added, removed
        self.registered = {a: w for a, w in self.registered.items() if a in known}
        for address in sorted(set(self.registered) - set(want)):
            try:
                self.deregister(address)
                removed.append(address)
            except grpc.RpcError as e:
                logger.warning("deregister %s from router %s failed: %s", address, self.router_address, e.code())
        for address, w in sorted(want.items()):
            if self.registered.get(address) == w:
                continue
            try:
                self.register(w)
                added.append(address)
            except grpc.RpcError as e:
                logger.warning("register %s with router %s failed: %s", address, self.router_address, e.code())
        return added, removed

    def close(self) -> None:
        self._channel.close()
