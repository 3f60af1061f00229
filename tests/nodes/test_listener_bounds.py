"""Pre-auth bounds of a node's listeners (issues 34, 54): the Mux socket caps unauthenticated connections per peer
and in all (at a bound the oldest is closed for the newcomer: a flood cannot lock anyone out), refuses a pre-hello
frame over a few KB, and a flood of them leaves the serving process's memory bounded and back where it was once the
flood ends. The metrics port and the SGLang HTTP port are bounded the same way."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from common.node import http_probe, ipc
from common.node.conn_budget import HELLO_FRAME_BYTES, PRE_AUTH_PER_PEER, ConnectionBudget, Slot
from common.node.mux_socket_server import MuxSocketServer
from common.testing.mock_config import MockConfig
from common.testing.mock_worker import MockWorker
from common.wire.mux_socket import MAX_FRAME_BYTES, connect

REPO = Path(__file__).resolve().parents[2]


def test_budget_reclaims_the_oldest_slot_of_the_largest_holder_and_returns_to_zero() -> None:
    b = ConnectionBudget("test", per_peer=3, total=5)
    closed: list[str] = []

    def admit(name: str) -> Slot:
        return b.admit(name[0], lambda: closed.append(name))

    slots = {n: admit(n) for n in ("a1", "a2", "a3")}
    slots["a4"] = admit("a4")  # at the per-peer bound: the host's own oldest goes
    assert closed == ["a1"] and not slots["a1"].held
    slots |= {n: admit(n) for n in ("b1", "b2")}  # 5 in all: a2 a3 a4 b1 b2
    slots["c1"] = admit("c1")  # at the total: the oldest of the largest holder (a), not the oldest overall
    slots["c2"] = admit("c2")  # a and b hold two each, c one: the older of a's and b's oldest (a3, before b1)
    slots["d1"] = admit("d1")  # b and c hold two each, a one: b1, before c1
    assert closed == ["a1", "a2", "a3", "b1"] and b.count == 5 and b.reclaimed == 4
    for s in slots.values():  # a reclaimed slot's release, or a second one, changes nothing
        b.release(s)
        b.release(s)
    assert b.count == 0 and closed == ["a1", "a2", "a3", "b1"]


async def _closed_soon(reader: asyncio.StreamReader, within: float = 2.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), within) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_mux_socket_closes_the_oldest_connections_over_the_per_peer_bound_and_big_pre_hello_frames() -> None:
    server = MuxSocketServer(MockWorker(MockConfig(role="decode")), credential="the-credential")
    port = await server.start("127.0.0.1")
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(PRE_AUTH_PER_PEER + 4):
            held.append(await asyncio.open_connection("127.0.0.1", port))
        await asyncio.sleep(0.2)
        closed = list(await asyncio.gather(*(_closed_soon(r, 0.3) for r, _ in held)))  # within the hello deadline
        assert closed == [True] * 4 + [False] * PRE_AUTH_PER_PEER
        assert server.budget.count == PRE_AUTH_PER_PEER
        for _, w in held:
            w.close()
        held.clear()
        for _ in range(50):  # the slots come back as the connections close
            if server.budget.count == 0:
                break
            await asyncio.sleep(0.05)
        assert server.budget.count == 0
        # A pre-hello frame larger than a hello could be loses the connection at its header.
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(struct.pack(">I", HELLO_FRAME_BYTES + 1) + b"\0" * 100)
        assert await _closed_soon(r)
        w.close()
        # The rightful router still gets in, and its connection no longer counts as unauthenticated.
        conn = await connect("127.0.0.1", port, "the-credential")
        assert conn.max_frame_bytes == MAX_FRAME_BYTES
        assert server.budget.count == 0 and not server.connections.pop().conn.lost
        conn.close()
    finally:
        for _, w in held:
            w.close()
        await server.stop()


_SERVE = """
import asyncio, sys
from common.node import http_probe, ipc
from common.node.mux_socket_server import MuxSocketServer
from common.testing.mock_config import MockConfig
from common.testing.mock_worker import MockWorker

async def main():
    server = MuxSocketServer(MockWorker(MockConfig(role="decode")), credential="the-credential")
    print(await server.start("127.0.0.1"), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin

asyncio.run(main())
"""


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _flood(port: int, conns: int, claim: int, send: int) -> list[socket.socket]:
    """``conns`` connections to the Mux socket, each a frame header claiming ``claim`` bytes then ``send`` of them."""
    held = []
    body = b"\0" * send
    for _ in range(conns):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        held.append(s)
        with contextlib.suppress(OSError):  # a refused connection is reset under our feet
            s.sendall(struct.pack(">I", claim) + body)
    return held


@pytest.mark.slow
def test_a_pre_hello_flood_leaves_the_serving_process_memory_bounded_and_back() -> None:
    """600 connections each holding a partial ~1 MB frame (the issue's attack): the process's RSS stays within
    a bound while they are open and returns near its start once they close."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'proto'}"}
    proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, cwd=REPO, text=True)
    held: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        time.sleep(0.5)
        base = _rss_mb(proc.pid)
        held = _flood(port, 600, MAX_FRAME_BYTES - 1, 1 << 20)
        time.sleep(1.0)
        during = _rss_mb(proc.pid)
        for s in held:
            s.close()
        held.clear()
        time.sleep(1.5)
        after = _rss_mb(proc.pid)
        # Unbounded, the flood held ~600 MB (and kept most of it after the close).
        assert during - base < 64, f"RSS {base:.0f} -> {during:.0f} MB during the flood"
        assert after - base < 32, f"RSS {base:.0f} -> {after:.0f} MB after the flood closed"
    finally:
        for s in held:
            s.close()
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_metrics_port_bounds_connections_per_peer_and_drops_silent_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_probe._QuietHandler, "timeout", 3.0)
    server = http_probe.start_probe_server(0, "127.0.0.1", lambda: None)
    port = server.server_address[1]
    held: list[socket.socket] = []
    try:
        for _ in range(PRE_AUTH_PER_PEER + 3):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        for _ in range(100):  # the accept loop takes them one by one
            if server.budget.reclaimed >= 3:
                break
            time.sleep(0.02)
        assert server.budget.count == PRE_AUTH_PER_PEER and server.budget.reclaimed == 3
        assert [s.recv(1) for s in held[:3]] == [b""] * 3  # the oldest, closed for the newest
        t0 = time.monotonic()
        assert [s.recv(1) for s in held[3:]] == [b""] * PRE_AUTH_PER_PEER  # silent: dropped
        assert time.monotonic() - t0 < 6
        for _ in range(50):
            if server.budget.count == 0:
                break
            time.sleep(0.05)
        assert server.budget.count == 0
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # the port serves again
            s.sendall(b"GET /liveness HTTP/1.0\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.0 200")
    finally:
        for s in held:
            s.close()
        server.shutdown()
        server.server_close()


def test_a_new_front_sweeps_the_ipc_files_a_killed_front_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = [tmp_path / f"pdcluster-{dead.pid}-0123abcd.out", tmp_path / f"pdcluster-{dead.pid}-0123abcd-rank0.in"]
    live = [tmp_path / f"pdcluster-{os.getpid()}-4567beef.out", tmp_path / "pdcluster-unrelated.txt"]
    for p in left + live:
        p.write_bytes(b"")
    addrs = ipc.IpcAddrs.new()  # what a starting front does
    assert addrs.base.startswith(str(tmp_path))
    assert [p.exists() for p in left + live] == [False, False, True, True]
