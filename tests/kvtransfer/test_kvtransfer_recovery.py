"""Recovery of the tcp data plane: a dropped connection and a stalled peer (SIGSTOP, then SIGCONT) leave no stale
socket behind; the next rooms succeed within seconds."""

from __future__ import annotations

import threading
import time

import pytest

from kvtransfer.bootstrap import BootstrapServer
from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.manager import KVManager
from kvtransfer.poll import KVPoll
from kvtransfer.prefill_rooms import PrefillRooms
from kvtransfer.testing import (
    DECODE_SEED,
    PREFILL_SEED,
    TOKEN,
    Child,
    RoleSpec,
    drive_senders,
    kv_config,
    make_args,
    plan_rooms,
    start_receivers,
    wait_final,
)

pytestmark = pytest.mark.slow
NUM_PAGES = 64


def _transfer(prefill: KVManager, decode: KVManager, plans, bootstrap_addr: str) -> dict[int, tuple[int, str]]:
    sent: dict[int, tuple[int, str]] = {}
    t = threading.Thread(target=lambda: sent.update(drive_senders(prefill, plans, 20.0)), daemon=True)
    t.start()
    received = wait_final(start_receivers(decode, plans, bootstrap_addr), 20.0)
    t.join(25)
    assert not t.is_alive()
    return {room: received[room] if received[room][0] != KVPoll.Success else sent[room] for room in received}


def _accepted(decode: KVManager) -> set[int]:
    with decode.backend._lock:  # type: ignore[attr-defined]
        return {id(s) for s in decode.backend._accepted}  # type: ignore[attr-defined]


def _drop_connections(decode: KVManager) -> None:
    """The decode side's data connections are reset under the prefill side (a middlebox, a peer's restart)."""
    with decode.backend._lock:  # type: ignore[attr-defined]
        socks = list(decode.backend._accepted)  # type: ignore[attr-defined]
    assert socks
    for sock in socks:
        sock.shutdown(2)


def test_dropped_tcp_connection_is_reopened_for_the_next_rooms() -> None:
    server = BootstrapServer(TOKEN)
    port = server.start()
    addr = f"127.0.0.1:{port}"
    config = kv_config("tcp")
    prefill = KVManager(make_args(PREFILL_SEED, NUM_PAGES), config, PrefillRooms, bootstrap_addr=addr)
    decode = KVManager(make_args(DECODE_SEED, NUM_PAGES), config, DecodeRooms)
    try:
        first, second, third = (plan_rooms(3, NUM_PAGES, NUM_PAGES, pages_per_room=6, seed=21)[i:i + 1]
                                for i in range(3))
        assert all(state == KVPoll.Success for state, _ in _transfer(prefill, decode, first, addr).values())
        before = _accepted(decode)
        _drop_connections(decode)
        for plans in (second, third):
            result = _transfer(prefill, decode, plans, addr)
            assert all(state == KVPoll.Success for state, _ in result.values()), result
        assert _accepted(decode) and not _accepted(decode) & before  # a new connection carries them
        # The pages landed where the decode side asked for them.
        for plan in second + third:
            for src, dst in zip(plan.src_pages, plan.dst_pages, strict=True):
                ps = prefill.args.page_size
                assert decode.args.k_buffers[0][dst * ps:(dst + 1) * ps].equal(
                    prefill.args.k_buffers[0][src * ps:(src + 1) * ps])
    finally:
        prefill.close()
        decode.close()
        server.stop()


@pytest.mark.parametrize("backend", ["tcp", "shm", "nixl", "ucx", "mooncake", "nccl"])
def test_stalled_prefill_recovers_after_sigcont(backend: str) -> None:
    """Both sides lose each other; after SIGCONT decode handshakes again with the same prefill epoch, which drops
    and re-adds it (shm, nixl: the old worker's end once released the re-added pool or agent, failing every later
    room)."""
    overrides = {"bootstrap_timeout_s": 30.0, "waiting_timeout_s": 30.0}
    first, during, after, later = plan_rooms(4, NUM_PAGES, NUM_PAGES, pages_per_room=6, seed=22)
    child = Child(RoleSpec("prefill", backend, [first, during, after, later], num_pages=NUM_PAGES,
                           config_overrides=overrides))
    decode = KVManager(make_args(DECODE_SEED, NUM_PAGES), kv_config(backend, **overrides), DecodeRooms)
    try:
        result = wait_final(start_receivers(decode, [first], child.bootstrap_addr), 15)
        assert result[first.room][0] == KVPoll.Success, result
        child.pause()
        stalled = start_receivers(decode, [during], child.bootstrap_addr)
        time.sleep(decode.config.peer_dead_after_s * 3)  # far past the heartbeat deadline: each side loses the other
        result = wait_final(stalled, 1)
        assert result[during.room][0] == KVPoll.Failed and "silent" in result[during.room][1], result
        child.resume()
        resumed = time.monotonic()
        result = wait_final(start_receivers(decode, [after], child.bootstrap_addr), 10)
        assert result[after.room][0] == KVPoll.Success, result
        assert time.monotonic() - resumed < 10
        time.sleep(1.0)  # past the dropped peer's worker drain (0.5 s): rooms after it still move
        result = wait_final(start_receivers(decode, [later], child.bootstrap_addr), 10)
        assert result[later.room][0] == KVPoll.Success, result
    finally:
        child.kill()
        decode.close()
