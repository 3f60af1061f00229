"""Attacks on the tcp KV data listener (decode side): it allocates nothing and starts no transfer before the
connecting side proves the cluster secret, caps frames, and bounds unproven connections per host without locking
a proven peer out."""

from __future__ import annotations

import socket
import struct
import time
import tracemalloc

import pytest

from kvtransfer.backends.base import PeerInfo, PeerKey
from kvtransfer.backends.streamio import send_frame
from kvtransfer.backends.tcp import MAX_CONNS_PER_HOST, NONCE_BYTES
from kvtransfer.backends.wire import ChunkHeader, DataHello, data_proof
from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.manager import KVManager
from kvtransfer.testing import DECODE_SEED, TOKEN, kv_config, make_args


@pytest.fixture
def decode_mgr():
    mgr = KVManager(make_args(DECODE_SEED, 32), kv_config("tcp"), DecodeRooms)
    yield mgr
    mgr.close()


def _connect(mgr: KVManager) -> socket.socket:
    sock = socket.create_connection((mgr.endpoint["host"], int(mgr.endpoint["port"])), timeout=5)
    assert len(sock.recv(NONCE_BYTES, socket.MSG_WAITALL)) == NONCE_BYTES  # the challenge comes first
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_huge_declared_length_allocates_nothing(decode_mgr: KVManager) -> None:
    tracemalloc.start()
    try:
        socks = [_connect(decode_mgr) for _ in range(3)]
        for sock in socks:
            sock.sendall(struct.pack("<I", 1 << 30) + b"x")  # 5 bytes declaring a 1 GiB frame
        assert all(_closed_by_peer(s) for s in socks)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes traced while refusing 3 x 1 GiB frames"


def test_a_hello_without_the_secret_is_refused(decode_mgr: KVManager) -> None:
    sock = _connect(decode_mgr)
    # Even the identity of a real, accepted peer is not enough without the proof.
    send_frame(sock, DataHello("prefill/dp0/tp0@tcp://127.0.0.1:1", 1, b"\0" * 32))
    assert _closed_by_peer(sock)
    assert not decode_mgr.backend._accepted  # type: ignore[attr-defined]


def test_unproven_connections_per_host_give_way_to_a_proven_peer(decode_mgr: KVManager) -> None:
    """A host holding its whole bound of unproven connections: the next connection takes the oldest one's slot, so
    a prefill rank on that host still gets in; the slots come back when the connections close."""
    backend = decode_mgr.backend
    key = PeerKey("prefill/dp0/tp0@tcp://127.0.0.1:1", 1)
    backend.add_peer(PeerInfo(key, decode_mgr.layout, {}))
    socks = [_connect(decode_mgr) for _ in range(MAX_CONNS_PER_HOST)]
    try:
        sock = socket.create_connection((decode_mgr.endpoint["host"], int(decode_mgr.endpoint["port"])), timeout=5)
        socks.append(sock)
        nonce = sock.recv(NONCE_BYTES, socket.MSG_WAITALL)  # its challenge came: it holds the oldest one's slot
        assert _closed_by_peer(socks[0])
        send_frame(sock, DataHello(key.instance_id, key.epoch, data_proof(TOKEN, nonce, key.instance_id, key.epoch)))
        end = time.monotonic() + 5
        while not backend._accepted and time.monotonic() < end:  # type: ignore[attr-defined]
            time.sleep(0.01)
        assert list(backend._accepted.values()) == [key]  # type: ignore[attr-defined]
        assert backend._unproven.reclaimed >= 1  # type: ignore[attr-defined]
    finally:
        for s in socks:
            s.close()
    end = time.monotonic() + 5
    while (backend._unproven.count or backend._accepted) and time.monotonic() < end:  # type: ignore[attr-defined]
        time.sleep(0.01)
    assert backend._unproven.count == 0 and not backend._accepted  # type: ignore[attr-defined]


def test_a_proven_peer_cannot_declare_more_than_its_runs_hold(decode_mgr: KVManager) -> None:
    key = PeerKey("prefill/dp0/tp0@tcp://127.0.0.1:1", 1)
    decode_mgr.backend.add_peer(PeerInfo(key, decode_mgr.layout, {}))
    sock = socket.create_connection((decode_mgr.endpoint["host"], int(decode_mgr.endpoint["port"])), timeout=5)
    nonce = sock.recv(NONCE_BYTES, socket.MSG_WAITALL)
    send_frame(sock, DataHello(key.instance_id, key.epoch, data_proof(TOKEN, nonce, key.instance_id, key.epoch)))
    tracemalloc.start()
    try:
        send_frame(sock, ChunkHeader(room=1, chunk_id=0, dst_runs=[(1, 1)], heads=None, nbytes=1 << 40))
        assert _closed_by_peer(sock)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
