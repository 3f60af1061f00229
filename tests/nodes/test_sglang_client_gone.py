"""Clients of the node's SGLang HTTP port at the edges of a streamed response. One that leaves as the response's head
is written (the loop turn before aiohttp notices and cancels the handler): a disconnect, not a server error; the
request's outputs are closed (the front aborts it on its rank) and aiohttp logs no ERROR traceback
(``common/serving/client_gone.py``). One that speaks HTTP/1.0: the stream's end is the connection's close
(``common/serving/event_stream.py``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput, TokenOut
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


class _Finisher(_Recorder):
    """A WorkerServicer that streams three tokens and finishes."""

    async def run_request(self, msg: GenerateReqInput, rank: int, context: Any) -> AsyncIterator[Any]:
        n = len(msg.input_ids or [])
        for i, t in enumerate((5, 6, 7)):
            yield TokenOut(rid=msg.rid, token_ids=[t], prompt_tokens=n, completion_tokens=i + 1,
                           finish_reason="length" if i == 2 else None)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
async def test_an_http_1_0_client_gets_the_end_of_its_stream(model_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             path: str) -> None:
    """HTTP/1.0 has no chunks: the body of a streamed response ends with the connection. (aiohttp kept the
    connection of a keep-alive HTTP/1.0 client open after the last event, and the client waited forever.)"""
    monkeypatch.delenv("PDCLUSTER_API_KEY", raising=False)
    monkeypatch.delenv("PDCLUSTER_API_KEY_FILE", raising=False)
    args = ServerArgs(host="127.0.0.1", disaggregation_mode="null", sglang_http_port=0)
    server = SglangHttpServer(args, _Finisher(args, model_path))  # type: ignore[arg-type]
    await server.start()
    try:
        body: dict[str, Any] = {"stream": True, "max_tokens": 3, "prompt": "hello", "model": "m"} \
            if path.startswith("/v1") else {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 3}}
        url = f"http://127.0.0.1:{server.port}{path}"
        async with aiohttp.ClientSession(version=aiohttp.HttpVersion10) as s, s.post(url, json=body) as r:
            assert r.status == 200 and "Transfer-Encoding" not in r.headers
            raw = await asyncio.wait_for(r.read(), 20)
        assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: ") >= 4
    finally:
        await server.stop()
