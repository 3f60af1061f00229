"""A mock fleet (``common.testing.mock_worker``) behind an in-process ``RouterServer``, for the router tests and
benchmarks. Nothing here is imported by the serving processes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from openai import AsyncOpenAI

from common.testing.mock_config import MockConfig
from common.testing.mock_fleet import shared_model_dir
from common.testing.mock_requests import MockHub
from common.testing.mock_worker import MockWorker
from pdcluster.v1 import router_pb2_grpc
from router.config import RouterConfig, WorkerSpec
from router.server import RouterServer

FAST = {"health_interval_s": 0.1, "load_interval_s": 0.05, "retry_backoff_s": 0.01, "rpc_timeout_s": 1.0}


@dataclass
class Fleet:
    server: RouterServer
    prefill: list[MockWorker]
    decode: list[MockWorker]
    colocated: list[MockWorker]
    _closers: list[Any] = field(default_factory=list)

    @property
    def workers(self) -> list[MockWorker]:
        return self.prefill + self.decode + self.colocated

    def name(self, w: MockWorker) -> str:
        """The router's client-facing name of ``w`` (what ``served_by`` shows)."""
        return self.server.service.registry.workers[w.address].name

    def openai(self, **kw: Any) -> AsyncOpenAI:
        client = AsyncOpenAI(base_url=self.server.http_url + "/v1", api_key="unused", max_retries=0, **kw)
        self._closers.append(client)
        return client

    def stub(self) -> router_pb2_grpc.RouterStub:
        channel = grpc.aio.insecure_channel(self.server.grpc_address)
        self._closers.append(channel)
        return router_pb2_grpc.RouterStub(channel)


def _specs(n_or_list: int | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{} for _ in range(n_or_list)] if isinstance(n_or_list, int) else n_or_list


@contextlib.asynccontextmanager
async def fleet(
    prefill: int | list[dict[str, Any]] = 1,
    decode: int | list[dict[str, Any]] = 1,
    colocated: int | list[dict[str, Any]] = 0,
    common: dict[str, Any] | None = None,
    **router_kw: Any,
) -> AsyncIterator[Fleet]:
    hub = MockHub()
    groups: dict[str, list[MockWorker]] = {}
    for role, spec in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
        groups[role] = [
            MockWorker(MockConfig(role=role, **{**(common or {}), **kw}), hub) for kw in _specs(spec)
        ]
    everyone = [w for ws in groups.values() for w in ws]
    for w in everyone:
        await w.start()
    cfg = RouterConfig(
        model_path=str(shared_model_dir()),
        grpc_port=0,
        http_port=0,
        workers=tuple(WorkerSpec(w.address, w.cfg.role) for w in everyone),
        **{**FAST, **router_kw},
    )
    server = RouterServer(cfg)
    await server.start()
    f = Fleet(server, groups["prefill"], groups["decode"], groups["colocated"])
    try:
        yield f
    finally:
        for c in f._closers:
            await c.close()
        await server.stop(0)
        for w in everyone:
            await w.stop()


async def eventually(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
