"""A client of the node's SGLang HTTP port that leaves as its streamed response's head is written (the loop turn
before aiohttp notices and cancels the handler): a disconnect, not a server error. The request's outputs are closed
(the front aborts it on its rank) and aiohttp logs no ERROR traceback (``common/client_gone.py``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.config import ServerArgs
from common.io_struct import GenerateReqInput, TokenOut
from common.node.sglang_http import SglangHttpServer
from tests.http_helpers import close_before_head
from tests.nodes.test_sglang_guard import _Recorder


class _Streamer(_Recorder):
    """A WorkerServicer that streams one token, then waits for more until its outputs are closed."""

    def __init__(self, args: ServerArgs, model_path: Path) -> None:
        super().__init__(args, model_path)
        self.closed: list[str] = []

    async def run_request(self, msg: GenerateReqInput, rank: int, context: Any) -> AsyncIterator[Any]:
        try:
            yield TokenOut(rid=msg.rid, token_ids=[5], prompt_tokens=len(msg.input_ids or []))
            await asyncio.sleep(30)
        finally:
            self.closed.append(msg.rid)


async def test_a_client_gone_as_the_head_is_written_closes_the_request_without_an_error_log(
        model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("PDCLUSTER_API_KEY", raising=False)
    monkeypatch.delenv("PDCLUSTER_API_KEY_FILE", raising=False)
    close_before_head(monkeypatch, "gone-at-head")
    caplog.set_level(logging.ERROR, logger="aiohttp.server")
    args = ServerArgs(host="127.0.0.1", disaggregation_mode="null", sglang_http_port=0)
    servicer = _Streamer(args, model_path)
    server = SglangHttpServer(args, servicer)  # type: ignore[arg-type]
    await server.start()
    try:
        body = {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 8}}
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientError):
                async with s.post(f"http://127.0.0.1:{server.port}/generate", json=body,
                                  headers={"X-Request-ID": "gone-at-head"}) as r:
                    await r.read()
        for _ in range(100):
            if servicer.closed:
                break
            await asyncio.sleep(0.02)
        assert servicer.closed == ["gone-at-head"]
    finally:
        await server.stop()
    assert [r.getMessage() for r in caplog.records if r.name == "aiohttp.server"] == []
