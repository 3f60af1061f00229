"""What KV control-plane authentication costs (``kvtransfer/auth.py``), in one process on 127.0.0.1.

    handshake: a decode manager meeting a prefill rank for the first time — Hello, HelloChallenge, HelloProof,
               sealed HelloAck (two round trips, four HMACs a side) — timed from the decode's Hello to the accepted
               peer. Paid once per (decode rank, prefill rank start), never per request.
    per message: seal + verify of one control message (HMAC-SHA256 of ~100 bytes), which every TransferInfo,
               ChunkDone, Status and Heartbeat now pays; a request exchanges 2 + (number of chunks) of them.

    python benchmarks/auth_overhead.py [--peers 20] [--messages 20000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvtransfer import auth
from kvtransfer.args import KVTransferConfig
from kvtransfer.bootstrap import BootstrapServer
from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.manager import KVManager
from kvtransfer.messages import ChunkDone, encode
from kvtransfer.prefill_rooms import PrefillRooms
from kvtransfer.receiver import KVReceiver
from kvtransfer.testing import DECODE_SEED, PREFILL_SEED, make_args

SECRET = "benchmark-only-secret-value"


def handshake_ms(peers: int) -> list[float]:
    """Each sample: a fresh decode manager handshakes with one prefill rank (lookups excluded)."""
    config = KVTransferConfig(backend="fake", cluster_token=SECRET, heartbeat_interval_s=5.0)
    server = BootstrapServer(SECRET)
    port = server.start()
    prefill = KVManager(make_args(PREFILL_SEED, 16), config, PrefillRooms, bootstrap_addr=f"127.0.0.1:{port}")
    samples = []
    try:
        for i in range(peers):
            decode = KVManager(make_args(DECODE_SEED, 16), config, DecodeRooms)
            rooms = decode.rooms
            receiver = KVReceiver(decode, 1000 + i, f"127.0.0.1:{port}")
            receiver.init(0)
            end = time.monotonic() + 10
            while prefill.instance_id not in rooms.handshakes.connecting and time.monotonic() < end:  # type: ignore[union-attr]
                time.sleep(0.00002)
            start = time.perf_counter()
            while prefill.instance_id not in decode.peers and time.monotonic() < end:
                time.sleep(0.00002)
            samples.append((time.perf_counter() - start) * 1000)
            receiver.abort("benchmark done")
            decode.close()
    finally:
        prefill.close()
        server.stop()
    return samples


def per_message_us(n: int) -> float:
    key = auth.session_key(SECRET, b"t")
    payload = encode(ChunkDone(instance_id="prefill/dp0/tp0@tcp://127.0.0.1:5555", epoch=time.time_ns(), room=42,
                               chunk_id=3, num_pages=8))
    start = time.perf_counter()
    for seq in range(1, n + 1):
        assert auth.open_seal(key, seq - 1, auth.seal(key, seq, payload)) == seq
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=20)
    p.add_argument("--messages", type=int, default=20000)
    ns = p.parse_args()
    hs = handshake_ms(ns.peers)
    print(f"handshake (once per peer start): median {statistics.median(hs):.3f} ms, max {max(hs):.3f} ms "
          f"over {len(hs)} peers")
    print(f"seal + verify per control message: {per_message_us(ns.messages):.2f} us")


if __name__ == "__main__":
    main()
