"""The Mux socket (common/wire/mux_socket.py, common/node/mux_socket_server.py): the router's request legs on a plain TCP
connection offered on the gRPC Mux stream; the hello's credential, the fallback to gRPC, framing faults."""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
import time
from typing import Any

import grpc
import pytest

from common.config import ServerArgs
from common.errors import ConfigError
from common.node import mux_socket_server
from common.node.mux_socket_server import MuxSocketServer
from common.testing.mock_config import MockConfig
from common.testing.mock_requests import fake_tokens
from common.testing.mock_worker import MockWorker
from common.wire import mux_socket
from common.wire.mux_socket import FrameConnection, FrameError, connect
from pdcluster.v1 import common_pb2, router_pb2, worker_pb2
from router.cli import add_router_args, config_from_args
from router.config import RouterConfig
from router.mux import io as router_mux
from router.testing import eventually, fleet
from tests.mux_helpers import gen_req, linked, read_all


async def generate(stub: Any, rid: str) -> router_pb2.RouterGenerateResponse:
    req = router_pb2.RouterGenerateRequest(request_id=rid, input_ids=router_pb2.TokenIds(ids=[10, 11, 12]),
                                           sampling_params=common_pb2.SamplingParams(max_new_tokens=3))
    return [m async for m in stub.Generate(req)][-1]


@pytest.mark.parametrize("transport", ["socket", "grpc"])
async def test_router_legs_ride_the_offered_socket_unless_told_grpc(transport: str) -> None:
    async with fleet(prefill=1, decode=1, mux_transport=transport) as f:
        stub = f.stub()
        done = await asyncio.gather(*(generate(stub, f"r{i}") for i in range(16)))
        assert [list(m.complete.output_ids) for m in done] == [fake_tokens([10, 11, 12], 3, 1536)] * 16
        for w in f.workers:
            link = f.server.service.registry.workers[w.address].mux
            assert link.stream is not None and link.stream.transport == transport
            methods = [m for m, _ in w.calls]
            assert methods.count("Mux-socket") == (transport == "socket")
            assert "Prefill" not in methods and "Decode" not in methods
        listed = {s["address"]: s for s in f.server.service.list_workers()}
        assert {(s["legs_transport"], s["mux_socket_error"]) for s in listed.values()} == {(transport, "")}
        assert f.server.service.pipeline.planner.rooms.in_flight == set()


async def test_an_unreachable_socket_leaves_the_legs_on_the_grpc_stream() -> None:
    async with linked() as (w, link):
        assert w._mux_socket is not None
        port = w.mux_socket_port
        await w._mux_socket.stop()  # still offered on the Mux stream, but nothing listens
        w.mux_socket_port = port
        stream = await link.get(5)
        assert stream is not None and stream.transport == link.transport == "grpc"
        assert "Connect" in link.socket_error or "refused" in link.socket_error.lower()
        assert await read_all(stream.open("generate", gen_req("g", [3, 4], 5), 10)) == fake_tokens([3, 4], 5, 1536)


async def test_a_hello_without_the_credential_is_refused_and_serves_nothing() -> None:
    w = MockWorker(MockConfig(role="colocated"))
    server = MuxSocketServer(w, credential="the-credential")
    port = await server.start("127.0.0.1")
    try:
        with pytest.raises(ConnectionError, match=r"refused the hello.*PDCLUSTER_CLUSTER_TOKEN"):
            await connect("127.0.0.1", port, "a-guess")
        # A first frame that is not a hello (a request) is refused too, and never reaches a handler.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = worker_pb2.MuxFrame(messages=[worker_pb2.MuxMessage(stream_id=1, generate=gen_req("x", [1, 2]))])
        writer.write(struct.pack(">I", data.ByteSize()) + data.SerializeToString())
        (n,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), 3))
        refusal = worker_pb2.MuxFrame.FromString(await reader.readexactly(n))
        assert refusal.messages[0].status.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert await asyncio.wait_for(reader.read(), 3) == b""  # then closed
        writer.close()
        assert not w.records
        conn = await connect("127.0.0.1", port, "the-credential")
        conn.close()
        await eventually(lambda: not server.connections)
    finally:
        await server.stop()


async def test_a_connection_without_a_hello_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mux_socket_server, "HELLO_TIMEOUT_S", 0.2)
    server = MuxSocketServer(MockWorker(MockConfig(role="colocated")), credential=None)
    port = await server.start("127.0.0.1")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 3) == b""
        assert time.monotonic() - t0 < 2
        writer.close()
        await eventually(lambda: not server.connections)
    finally:
        await server.stop()


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff\xff", struct.pack(">I", 3) + b"\x0a\xff\xff"])
async def test_a_bad_frame_drops_the_connection_and_cancels_exactly_its_requests(garbage: bytes) -> None:
    async with linked(hang=True) as (w, link), linked(itl=0.01) as (_v, other):
        stream, calm = await link.get(5), await other.get(5)
        assert stream is not None and stream.transport == "socket" and calm is not None
        hung = stream.open("generate", gen_req("hung", [5, 6]), 30)
        going = calm.open("generate", gen_req("going", [5, 7], 20), 30)
        await eventually(lambda: "hung" in w.active)
        assert isinstance(stream.io, object) and stream.io.conn.transport is not None  # type: ignore[union-attr]
        stream.io.conn.transport.write(garbage)  # type: ignore[union-attr]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(hung.read(), 5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        await eventually(lambda: "hung" in w.cancelled and not w.active)
        assert len(await read_all(going)) == 20  # the other worker's stream never noticed
        again = await link.get(5)  # the next request reconnects
        assert again is not None and again is not stream and again.transport == "socket"
        again.open("generate", gen_req("after", [5, 8]), 0.5).cancel()


class _Sink(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _framed(frame: worker_pb2.MuxFrame) -> bytes:
    data = frame.SerializeToString()
    return struct.pack(">I", len(data)) + data


@pytest.mark.parametrize("piece", [1, 3, 4096, 1 << 20])
def test_frames_split_anywhere_arrive_whole_and_in_order(piece: int) -> None:
    frames = [worker_pb2.MuxFrame(messages=[worker_pb2.MuxMessage(stream_id=i, fragment=worker_pb2.MuxFragment(
        data=bytes([i]) * size))]) for i, size in enumerate([0, 10, 200_000, 7, 900_000])]
    wire = b"".join(_framed(f) for f in frames)
    conn, got, lost = FrameConnection(), [], []
    conn.on_frame, conn.on_lost = got.append, lost.append
    conn.connection_made(_Sink())
    for i in range(0, len(wire), piece):
        conn.data_received(wire[i : i + piece])
    assert got == frames and not lost


def test_an_oversized_frame_header_loses_the_connection_before_its_body() -> None:
    conn, got, lost = FrameConnection(), [], []
    conn.on_frame, conn.on_lost = got.append, lost.append
    sink = _Sink()
    conn.connection_made(sink)
    conn.data_received(struct.pack(">I", mux_socket.MAX_FRAME_BYTES + 1))
    assert not got and len(lost) == 1 and isinstance(lost[0], FrameError) and sink.closed
    conn.data_received(_framed(worker_pb2.MuxFrame()))  # nothing is delivered after the loss
    assert not got and len(lost) == 1


def test_both_ends_work_on_uvloop() -> None:
    """The router runs on uvloop (common/event_loop.py), whose transports are not asyncio's classes."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> tuple[str, list[int]]:
        async with linked() as (_w, link):
            stream = await link.get(5)
            assert stream is not None
            return stream.transport, await read_all(stream.open("generate", gen_req("uv", [3, 4], 5), 10))

    assert uvloop.run(main()) == ("socket", fake_tokens([3, 4], 5, 1536))


async def test_a_node_that_stops_answering_fails_its_socket_by_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped node process keeps its TCP connection open (its kernel still acknowledges): the router's keepalive
    fails the socket and its requests, long before their deadlines."""
    monkeypatch.setattr(router_mux, "KEEPALIVE_IDLE_S", 0.3)
    monkeypatch.setattr(router_mux, "KEEPALIVE_TIMEOUT_S", 0.3)
    async with linked(hang=True) as (w, link):
        stream = await link.get(5)
        assert stream is not None and stream.transport == "socket"
        await asyncio.sleep(1.0)  # idle: pinged and answered, more than once
        assert stream.alive and stream.io.seq >= 2  # type: ignore[union-attr]
        hung = stream.open("generate", gen_req("stuck", [5, 6]), 60)
        await eventually(lambda: "stuck" in w.active)
        assert w._mux_socket is not None
        (node_end,) = w._mux_socket.connections
        node_end.conn.transport.pause_reading()  # type: ignore[union-attr]  (the node hears nothing more)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(hung.read(), 5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "keepalive" in e.value.details()
        assert time.monotonic() - t0 < 2.0 and not stream.alive
        node_end.conn.transport.resume_reading()  # type: ignore[union-attr]
        await eventually(lambda: not w.active)  # the node saw the connection end and cancelled the request


def test_bad_mux_flags_are_config_errors_naming_the_flag() -> None:
    for port in (-2, 65536):
        with pytest.raises(ConfigError, match="--mux-port"):
            ServerArgs(mux_port=port)
    assert ServerArgs(mux_port=-1).mux_port == -1
    with pytest.raises(ConfigError, match="--mux-transport must be one of socket, grpc"):
        RouterConfig(mux_transport="udp")
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--mux-transport", "udp"])
    assert config_from_args(parser.parse_args(["--mux-transport", "grpc"])).mux_transport == "grpc"


async def test_a_taken_mux_port_stops_the_node_with_the_flag_named() -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        server = MuxSocketServer(MockWorker(MockConfig(role="colocated")), credential=None)
        with pytest.raises(OSError, match=r"cannot bind the Mux socket port 127\.0\.0\.1:\d+ \(--mux-port"):
            await server.start("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()


async def test_a_router_loop_held_up_past_the_keepalive_does_not_fail_an_answered_socket(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ping's answer arrived while the router's loop was blocked: the late check reads it, it does not fail."""
    monkeypatch.setattr(router_mux, "KEEPALIVE_IDLE_S", 0.2)
    monkeypatch.setattr(router_mux, "KEEPALIVE_TIMEOUT_S", 0.2)
    async with linked() as (_w, link):
        stream = await link.get(5)
        assert stream is not None and stream.transport == "socket"
        io = stream.io
        pinged = asyncio.Event()
        send_now = io.conn.send_now  # type: ignore[union-attr]

        def send_then_hold_up(frame: worker_pb2.MuxFrame) -> None:
            send_now(frame)
            if not pinged.is_set() and any(m.HasField("ping") for m in frame.messages):
                pinged.set()
                time.sleep(0.6)  # the router's loop held up right after its ping went out: the answer waits

        # (held up from inside the send: a poll for the unanswered ping can miss it, answered within a loop turn)
        io.conn.send_now = send_then_hold_up  # type: ignore[union-attr]
        await asyncio.wait_for(pinged.wait(), 5)
        await asyncio.sleep(0.3)
        assert stream.alive and io.seq >= 1  # type: ignore[union-attr]
