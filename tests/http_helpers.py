"""HTTP test helpers shared by the router's and the nodes' tests."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web


def close_before_head(monkeypatch: pytest.MonkeyPatch, rid: str) -> None:
    """The client of request ``rid`` (its ``X-Request-ID``) starts closing just before the handler writes the response's
    head: the loop turn before aiohttp notices the loss and cancels the handler, whose write then fails."""
    prepare = web.StreamResponse.prepare

    async def closing_first(self: web.StreamResponse, request: web.BaseRequest) -> Any:
        if request.headers.get("X-Request-ID") == rid and request.transport is not None:
            request.transport.close()
        return await prepare(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", closing_first)
