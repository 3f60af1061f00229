"""Attacks on the KV control plane and the Bootstrap service (all on 127.0.0.1): a forged heartbeat or epoch, a
hijacking RegisterRank, and a decode node told (by a client) to resolve an attacker's bootstrap address."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import zmq

from kvtransfer import auth
from kvtransfer.bootstrap import BootstrapClient, BootstrapError, BootstrapServer, RankEntry
from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.manager import KVManager
from kvtransfer.messages import ChunkDone, Heartbeat, HelloChallenge, decode, encode
from kvtransfer.poll import KVPoll
from kvtransfer.prefill_rooms import PrefillRooms
from kvtransfer.testing import (
    DECODE_SEED,
    PREFILL_SEED,
    TOKEN,
    drive_senders,
    kv_config,
    make_args,
    plan_rooms,
    start_receivers,
    wait_final,
)

NUM_PAGES = 32


def _wait(predicate, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture
def pair():
    """A prefill and a decode manager (fake data plane) that completed one room, so each knows the other."""
    config = kv_config("fake")
    server = BootstrapServer(TOKEN)
    port = server.start()
    prefill = KVManager(make_args(PREFILL_SEED, NUM_PAGES), config, PrefillRooms, bootstrap_addr=f"127.0.0.1:{port}")
    decode_mgr = KVManager(make_args(DECODE_SEED, NUM_PAGES), config, DecodeRooms)
    plans = plan_rooms(2, NUM_PAGES, NUM_PAGES, pages_per_room=2, seed=3)
    sent: dict = {}
    sender_thread = threading.Thread(target=lambda: sent.update(drive_senders(prefill, plans[:1], 10)))
    sender_thread.start()
    got = wait_final(start_receivers(decode_mgr, plans[:1], f"127.0.0.1:{port}"), 10)
    sender_thread.join(10)
    assert got[plans[0].room][0] == KVPoll.Success and sent[plans[0].room][0] == KVPoll.Success
    yield prefill, decode_mgr, plans[1], port
    decode_mgr.close()
    prefill.close()
    server.stop()


def _forge(addr: str, frames: list[bytes]) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(addr)
    sock.send_multipart(frames)
    sock.close()


def test_spoofed_heartbeat_with_a_newer_epoch_changes_nothing(pair) -> None:
    prefill, decode_mgr, _, _ = pair
    before = prefill.peers[decode_mgr.instance_id].key
    drops = prefill.auth_drops.total()
    forged = encode(Heartbeat(instance_id=decode_mgr.instance_id, epoch=decode_mgr.epoch + 10**9))
    _forge(prefill.control.address, [forged])
    _forge(prefill.control.address, auth.seal(b"not-the-session-key" * 2, 10**6, forged))
    # The right epoch but no valid MAC: still dropped.
    same_epoch = encode(Heartbeat(instance_id=decode_mgr.instance_id, epoch=decode_mgr.epoch))
    _forge(prefill.control.address, auth.seal(b"x" * 32, 10**6, same_epoch))
    _wait(lambda: prefill.auth_drops.total() >= drops + 3, 5)
    assert prefill.peers[decode_mgr.instance_id].key == before
    assert prefill.auth_drops.snapshot().get("bad_mac", 0) >= 2


def test_forged_room_message_is_dropped_and_the_room_still_completes(pair) -> None:
    prefill, decode_mgr, plan, port = pair
    receiver = start_receivers(decode_mgr, [plan], f"127.0.0.1:{port}")
    _wait(lambda: receiver[plan.room].poll() >= KVPoll.WaitingForInput, 10)
    peer = decode_mgr.peers[prefill.instance_id]
    forged = ChunkDone(instance_id=prefill.instance_id, epoch=peer.key.epoch, room=plan.room, chunk_id=0,
                       num_pages=2, num_chunks=1, metadata=plan.metadata())
    _forge(decode_mgr.control.address, [encode(forged)])
    _wait(lambda: decode_mgr.auth_drops.total() >= 1, 5)
    assert receiver[plan.room].poll() == KVPoll.WaitingForInput
    sent = drive_senders(prefill, [plan], 10)
    assert sent[plan.room][0] == KVPoll.Success
    assert wait_final(receiver, 10)[plan.room][0] == KVPoll.Success


def test_hijacking_register_rank_is_refused_and_the_real_rank_stays(pair) -> None:
    prefill, _, _, port = pair
    attacker = BootstrapClient(f"127.0.0.1:{port}")
    rogue = RankEntry("tcp://127.0.0.1:1", prefill.instance_id, prefill.epoch + 10**9)
    try:
        for secret in ("", "a-guessed-secret-value"):
            with pytest.raises(BootstrapError) as exc:
                attacker.register(0, 0, 1, 1, rogue, secret)
            assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert attacker.rank(0, 0) == RankEntry(prefill.control.address, prefill.instance_id, prefill.epoch)
        # The legitimate rank re-registers (e.g. after a restart) without being locked out.
        attacker.register(0, 0, 1, 1, RankEntry(prefill.control.address, prefill.instance_id, prefill.epoch + 1),
                          TOKEN)
        assert attacker.rank(0, 0).epoch == prefill.epoch + 1
    finally:
        attacker.close()


def test_secret_never_goes_to_an_address_a_client_named() -> None:
    """A Decode RPC names the attacker's bootstrap address: the decode rank sends no secret and no proof there."""
    attacker_secret = "the-attacker-does-not-know-the-secret"
    ctx = zmq.Context.instance()
    listener = ctx.socket(zmq.ROUTER)
    listener.setsockopt(zmq.LINGER, 0)
    control_port = listener.bind_to_random_port("tcp://127.0.0.1")
    rogue_bootstrap = BootstrapServer(attacker_secret)
    port = rogue_bootstrap.start()
    client = BootstrapClient(f"127.0.0.1:{port}")
    client.register(0, 0, 1, 1, RankEntry(f"tcp://127.0.0.1:{control_port}", "prefill/dp0/tp0@rogue", 1),
                    attacker_secret)
    decode_mgr = KVManager(make_args(DECODE_SEED, NUM_PAGES), kv_config("fake"), DecodeRooms)
    plan = plan_rooms(1, NUM_PAGES, NUM_PAGES, pages_per_room=2, seed=4)[0]
    received: list[bytes] = []
    try:
        receiver = start_receivers(decode_mgr, [plan], f"127.0.0.1:{port}")[plan.room]
        poller = zmq.Poller()
        poller.register(listener, zmq.POLLIN)
        end = time.monotonic() + 10
        while not receiver.poll().is_final and time.monotonic() < end:
            if poller.poll(50):
                frames = listener.recv_multipart()
                received.extend(frames[1:])
                msg = decode(frames[1])
                if type(msg).__name__ == "Hello":  # answer with a challenge whose proof is a guess
                    _forge(msg.control_addr, [encode(HelloChallenge(
                        instance_id="prefill/dp0/tp0@rogue", epoch=1, hello_nonce=msg.nonce, nonce=b"n" * 16,
                        proof=b"p" * 32))])
        assert receiver.poll() == KVPoll.Failed and "could not prove" in receiver.failure()
        kinds = {type(decode(f)).__name__ for f in received}  # every frame a bare payload: nothing was sealed
        assert kinds == {"Hello"}, kinds  # no HelloProof, no TransferInfo
        assert not any(TOKEN.encode() in f for f in received)
        assert decode_mgr.auth_drops.snapshot().get("bad_proof") == 1
    finally:
        decode_mgr.close()
        client.close()
        rogue_bootstrap.stop()
        listener.close(0)
