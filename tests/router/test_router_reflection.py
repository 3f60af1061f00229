"""The router's gRPC port describes itself: reflection lists and describes ``pdcluster.v1.Router`` and
``grpc.health.v1.Health`` (what ``grpcurl`` needs without the .proto files)."""

from __future__ import annotations

import asyncio

from router.testing import fleet
from tests.grpc_helpers import reflected_services


async def test_reflection_lists_and_describes_router_and_health() -> None:
    async with fleet(prefill=1, decode=1) as f:
        services = await asyncio.to_thread(reflected_services, f.server.grpc_address)
    assert {"pdcluster.v1.Router", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
        services), f"reflection lists {sorted(services)}"
    assert "Generate" in services["pdcluster.v1.Router"]
    assert "Check" in services["grpc.health.v1.Health"]
