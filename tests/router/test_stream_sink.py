"""A streamed HTTP response's tokens written from the Mux stream's message callback (``SseSink``, ``MuxCall.sink``),
not by waking the request's handler task per token: same events, same order, and stop strings, client disconnects,
slow clients and a failing sink end only their own request."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from aiohttp.http_writer import StreamWriter

from common.testing.mock_fleet import shared_model_dir
from common.testing.mock_requests import fake_tokens
from common.text.tokenizer import load_tokenizer
from pdcluster.v1 import worker_pb2
from router import sse
from router.mux import MuxCall
from router.request import Delta
from router.testing import eventually, fleet
from tests.http_helpers import close_before_head

PACED = {"itl": 0.01}  # one token per message, apart: each reaches the router as a wake-up of its own


def expected_text(prompt: str, n: int) -> str:
    tok = load_tokenizer(shared_model_dir())
    return tok.decode(fake_tokens(tok.encode(prompt), n, 1536), skip_special_tokens=True)


@pytest.fixture
def sink_writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The text of every delta an ``SseSink`` wrote."""
    seen: list[str] = []
    write = sse.SseSink.write

    def counting(self: sse.SseSink, delta: Delta) -> None:
        seen.append(delta.text)
        write(self, delta)

    monkeypatch.setattr(sse.SseSink, "write", counting)
    return seen


async def _stream_text(client: Any, **kw: Any) -> tuple[str, str | None, int]:
    stream = await client.completions.create(model="mock-model", stream=True,
                                             stream_options={"include_usage": True}, **kw)
    text, reason, tokens = "", None, 0
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return text, reason, tokens


@pytest.mark.parametrize("layout", ["pd", "colocated"])
async def test_paced_tokens_are_written_by_the_sink_and_arrive_whole(layout: str, sink_writes: list[str]) -> None:
    roles = {"prefill": 1, "decode": 1} if layout == "pd" else {"prefill": 0, "decode": 0, "colocated": 1}
    async with fleet(**roles, common=PACED) as f:
        client = f.openai()
        text, reason, tokens = await _stream_text(client, prompt="Hello world", max_tokens=24)
        assert (text, reason, tokens) == (expected_text("Hello world", 24), "length", 24)
        # The first token goes through the handler (it sends the response's head); most of the rest do not.
        assert len(sink_writes) >= 12
        chat = await client.chat.completions.create(model="mock-model", max_tokens=16, stream=True,
                                                    messages=[{"role": "user", "content": "hi"}])
        pieces = [c.choices[0].delta.content async for c in chat if c.choices and c.choices[0].delta.content]
        assert len(pieces) >= 8 and len(sink_writes) >= 20
        await eventually(lambda: not f.server.service.core.active)


@pytest.fixture
def response_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every ``StreamResponse.write`` call's data (the head's first event, the handler's events, the sink's
    fallback); not the sink's chunks written into the transport itself."""
    seen: list[bytes] = []
    write = web.StreamResponse.write

    async def counting(self: web.StreamResponse, data: bytes) -> None:
        seen.append(data)
        await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counting)
    return seen


async def test_sink_events_go_into_the_transport_as_http_chunks(sink_writes: list[str],
                                                                response_writes: list[bytes]) -> None:
    async with fleet(prefill=1, decode=1, common=PACED) as f:
        text, reason, tokens = await _stream_text(f.openai(), prompt="Hello world", max_tokens=24)
        assert (text, reason, tokens) == (expected_text("Hello world", 24), "length", 24)
        assert len(sink_writes) >= 12
        # The handler's writes (the head's first event) only: through StreamResponse.write, each of the sink's
        # events with text would be one more.
        assert len(response_writes) < len([t for t in sink_writes if t]) / 2, (response_writes, sink_writes)


async def test_the_head_leaves_with_the_first_event_in_one_send(monkeypatch: pytest.MonkeyPatch) -> None:
    sends: list[bytes] = []  # what aiohttp's writer handed its transport, one entry per call
    write, writelines = StreamWriter._write, StreamWriter._writelines

    def one(self: StreamWriter, chunk: bytes) -> None:
        sends.append(bytes(chunk))
        write(self, chunk)

    def lines(self: StreamWriter, chunks: Any) -> None:
        sends.append(b"".join(chunks))
        writelines(self, chunks)

    monkeypatch.setattr(StreamWriter, "_write", one)
    monkeypatch.setattr(StreamWriter, "_writelines", lines)
    async with fleet(prefill=1, decode=1, common=PACED) as f:
        text, _, _ = await _stream_text(f.openai(), prompt="Hello world", max_tokens=8)
        assert text == expected_text("Hello world", 8)
    streamed = [i for i, b in enumerate(sends) if b.startswith(b"HTTP/1.1 200") and b"text/event-stream" in b]
    assert len(streamed) == 1, sends
    assert b"data: {" in sends[streamed[0]], sends[streamed[0]]  # not a send of its own before the first event


async def test_the_sink_writes_only_after_the_head_went_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first delta with no event (e.g. the first bytes of a character) must not let the sink write into the
    transport while the response's head is still held back: its chunk would precede the head."""
    of = sse.DeltaEvents.of
    dropped: list[str] = []

    def none_first(self: sse.DeltaEvents, i: int, ev: Delta) -> bytes | None:
        if not dropped:
            dropped.append(ev.text)
            return None
        return of(self, i, ev)

    monkeypatch.setattr(sse.DeltaEvents, "of", none_first)
    async with fleet(prefill=1, decode=1, common=PACED) as f:
        text, reason, tokens = await asyncio.wait_for(_stream_text(f.openai(), prompt="Hello world", max_tokens=24), 20)
        assert dropped and text == expected_text("Hello world", 24)[len(dropped[0]) :]
        assert (reason, tokens) == ("length", 24)


async def test_an_http_1_0_client_gets_the_stream_unchunked(sink_writes: list[str],
                                                           response_writes: list[bytes]) -> None:
    async with fleet(prefill=1, decode=1, common=PACED) as f, aiohttp.ClientSession(
            version=aiohttp.HttpVersion10) as http:
        body = {"model": "mock-model", "prompt": "Hello world", "max_tokens": 24, "stream": True}
        async with http.post(f.server.http_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200 and "Transfer-Encoding" not in resp.headers
            raw = await asyncio.wait_for(resp.read(), 20)  # the body ends when the router closes the connection
        events = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected_text("Hello world", 24)
        assert raw.endswith(b"data: [DONE]\n\n")
        # No chunks to frame: each of the sink's events (those with text) went through StreamResponse.write.
        assert sink_writes and len(response_writes) > len([t for t in sink_writes if t])


async def test_a_stop_string_in_a_sink_token_ends_the_request_and_aborts_both_legs(sink_writes: list[str]) -> None:
    full = expected_text("Hello world", 60)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert full.find(stop) > len(expected_text("Hello world", 3))  # matched in a token after the first few
    async with fleet(prefill=1, decode=1, common=PACED) as f:
        text, reason, tokens = await _stream_text(f.openai(), prompt="Hello world", max_tokens=60, stop=[stop],
                                                  extra_headers={"X-Request-ID": "stop-in-sink"})
        assert (text, reason) == (full[: full.find(stop)], "stop")
        assert tokens < 60 and sink_writes
        p, d = f.prefill[0], f.decode[0]
        await eventually(lambda: "stop-in-sink" in d.aborts and not d.active)
        assert "stop-in-sink" in p.aborts
        assert f.server.service.core.rooms.in_flight == set()


async def test_a_client_gone_mid_stream_aborts_both_legs(sink_writes: list[str]) -> None:
    async with fleet(prefill=1, decode=1, common=PACED) as f, aiohttp.ClientSession() as http:
        body = {"model": "mock-model", "prompt": "hi", "max_tokens": 400, "stream": True}
        async with http.post(f.server.http_url + "/v1/completions", json=body,
                             headers={"X-Request-ID": "gone"}) as resp:
            events = 0
            async for line in resp.content:
                events += line.startswith(b"data: ")
                if events == 6:
                    break
        assert sink_writes  # the tokens after the first came through the sink
        p, d = f.prefill[0], f.decode[0]
        await eventually(lambda: "gone" in p.aborts and "gone" in d.aborts and not d.active)
        await eventually(lambda: not f.server.service.core.active)


async def test_a_client_gone_as_its_head_is_written_is_a_disconnect_not_a_server_error(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The client's connection starts closing just before the handler writes the response's head: the loop turn
    before aiohttp notices the loss and cancels the handler, whose write then fails. No ERROR traceback (it was
    logged as a server error), both legs aborted, nothing left in flight."""
    close_before_head(monkeypatch, "gone-at-head")
    caplog.set_level(logging.ERROR, logger="aiohttp.server")
    async with fleet(prefill=1, decode=1, common=PACED) as f, aiohttp.ClientSession() as http:
        body = {"model": "mock-model", "prompt": "hi", "max_tokens": 400, "stream": True}
        with pytest.raises(aiohttp.ClientError):
            async with http.post(f.server.http_url + "/v1/completions", json=body,
                                 headers={"X-Request-ID": "gone-at-head"}) as resp:
                await resp.read()
        p, d = f.prefill[0], f.decode[0]
        await eventually(lambda: "gone-at-head" in p.aborts and "gone-at-head" in d.aborts and not d.active)
        await eventually(lambda: not f.server.service.core.active)
    assert [r.getMessage() for r in caplog.records if r.name == "aiohttp.server"] == []


class _Resp:
    """A response whose ``write`` suspends (as aiohttp's does to drain a full transport) while ``full`` is set."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.full: asyncio.Future[None] | None = None
        self.fail: BaseException | None = None

    async def write(self, data: bytes) -> None:
        if self.fail is not None:
            raise self.fail
        self.data.append(data)
        if self.full is not None:
            await self.full


def _sink(resp: _Resp, handler: asyncio.Task[Any], transport: Any = None) -> sse.SseSink:
    events = sse.DeltaEvents("completions", "r", "m", 0, 1, False, None, None)  # type: ignore[arg-type]
    s = sse.SseSink(resp, events, handler, transport)  # type: ignore[arg-type]
    s.live = True
    return s


class _Transport:
    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.queued = 0

    def get_write_buffer_size(self) -> int:
        return self.queued

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.data.append(data)


async def test_a_transport_with_a_backlog_sends_the_sink_through_the_response() -> None:
    """Below ``DIRECT_WRITE_LIMIT`` queued bytes an event is one HTTP chunk written into the transport; at it, the
    event takes ``StreamResponse.write``, whose drain waits for the client."""
    resp, handler, t = _Resp(), asyncio.create_task(asyncio.sleep(60)), _Transport()
    resp.chunked = True  # type: ignore[attr-defined]
    s = _sink(resp, handler, t)
    s.write(Delta("a", [1]))
    size, rest = t.data[0].split(b"\r\n", 1)
    assert int(size, 16) == len(rest) - 2 and rest.endswith(b"\n\n\r\n") and b'"text":"a"' in rest
    assert resp.data == []
    t.queued = sse.DIRECT_WRITE_LIMIT
    s.write(Delta("b", [2]))
    assert len(t.data) == 1 and len(resp.data) == 1 and b'"text":"b"' in resp.data[0]
    handler.cancel()


async def test_a_write_that_must_drain_finishes_before_the_sink_takes_more() -> None:
    resp, handler = _Resp(), asyncio.create_task(asyncio.sleep(60))
    s = _sink(resp, handler)
    s.write(Delta("a", [1]))
    resp.full = asyncio.get_running_loop().create_future()
    s.write(Delta("b", [2]))
    assert not s.ready()  # "b" is written, its drain pending: the next delta goes to the handler, after it
    assert [b'"text":"b"' in d for d in resp.data] == [False, True]
    resp.full.set_result(None)
    await eventually(s.ready)
    s.write(Delta("c", [3]))
    assert len(resp.data) == 3 and b'"text":"c"' in resp.data[2]
    assert not handler.done()
    handler.cancel()


async def test_a_failed_write_cancels_the_handler() -> None:
    resp, handler = _Resp(), asyncio.create_task(asyncio.sleep(60))
    s = _sink(resp, handler)
    resp.fail = ConnectionResetError("Cannot write to closing transport")
    s.write(Delta("a", [1]))
    assert not s.ready()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(handler, 5)


class _Writer:
    def __init__(self) -> None:
        self.sent: list[worker_pb2.MuxMessage] = []

    def send(self, msg: worker_pb2.MuxMessage) -> None:
        self.sent.append(msg)


class _Stream:
    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.calls: dict[int, MuxCall] = {}
        self.writer = _Writer()


def _chunk(token: int) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(chunk=worker_pb2.TokenChunk(token_ids=[token]))


async def test_the_sink_takes_a_message_only_while_the_reader_waits_with_nothing_queued() -> None:
    stream = _Stream()
    call = stream.calls[1] = MuxCall(stream, 1)  # type: ignore[arg-type]
    taken: list[int] = []
    call.sink = lambda m: bool(taken.append(m.chunk.token_ids[0])) or True
    call._deliver(_chunk(1))  # nobody reading yet: queued
    reader = asyncio.create_task(call.read())
    assert (await asyncio.wait_for(reader, 5)).chunk.token_ids[0] == 1
    reader = asyncio.create_task(call.read())
    await asyncio.sleep(0)  # the reader waits now
    call._deliver(_chunk(2))
    call._deliver(_chunk(3))
    assert taken == [2, 3] and not reader.done()
    call._end(grpc.aio.EOF)  # terminal items always reach the reader
    assert await asyncio.wait_for(reader, 5) is grpc.aio.EOF and taken == [2, 3]


async def test_a_sink_that_raises_ends_only_its_own_call() -> None:
    stream = _Stream()
    call = stream.calls[1] = MuxCall(stream, 1)  # type: ignore[arg-type]

    def broken(_m: Any) -> bool:
        raise ValueError("bug")

    call.sink = broken
    reader = asyncio.create_task(call.read())
    await asyncio.sleep(0)
    call._deliver(_chunk(1))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(reader, 5)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "failed to stream" in (e.value.details() or "")
    assert 1 not in stream.calls and stream.writer.sent[0].WhichOneof("kind") == "cancel"


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_prebuilt_events_are_the_bytes_of_the_chunk_they_stand_for(api: str) -> None:
    from router import openai_protocol as oai

    events = sse.DeltaEvents(api, 'cmpl-"x"', "mod\u00e9l", 17, 3, False, None, None)  # type: ignore[arg-type]
    for i in range(3):
        for text in ("a", ' q"\\\n\t', "\u00e9t\u00e9 \U0001f600", "\ufffd", "\x00z"):
            chunk = (oai.chat_chunk('cmpl-"x"', "mod\u00e9l", 17, {"content": text}, None, None, index=i)
                     if api == "chat" else oai.completion_chunk('cmpl-"x"', "mod\u00e9l", 17, text, None, None, index=i))
            assert events.of(i, Delta(text, [1])) == sse.sse(chunk)
    assert events.of(0, Delta("", [1])) is None
