"""Peer authentication of the KV control plane: challenge-response over nonces, then a MAC on every message.

The cluster secret K never crosses the wire. D = decode rank, P = prefill rank, T = the handshake transcript
(D's instance id and epoch, nonce_d, P's instance id and epoch, nonce_p)::

    D -> P  Hello(nonce_d, layout, endpoint)          nothing secret
    P -> D  HelloChallenge(nonce_d, nonce_p, proof_p) proof_p = HMAC(K, "prefill" | T)
    D -> P  HelloProof(proof_d)                       sent only once proof_p verified; proof_d = HMAC(K, "decode" | T)
    P -> D  HelloAck(...)                             sealed with the session key S = HMAC(K, "session" | T)

Every later message (and the HelloAck) travels as frames ``[payload, seq, mac]`` with ``seq`` 8 bytes big-endian and
``mac = HMAC-SHA256(S, seq | payload)``; ``seq`` strictly increases per direction and session, so a replayed or
forged message is dropped. Role labels keep one side's proof from being replayed as the other's.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import Counter

NONCE_BYTES = 16
SEQ_BYTES = 8


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def transcript(decode_id: str, decode_epoch: int, nonce_d: bytes, prefill_id: str, prefill_epoch: int,
               nonce_p: bytes) -> bytes:
    parts = [decode_id.encode(), str(decode_epoch).encode(), nonce_d, prefill_id.encode(), str(prefill_epoch).encode(),
             nonce_p]
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)  # length-prefixed: no ambiguous concatenation


def _mac(key: bytes, label: bytes, data: bytes) -> bytes:
    return hmac.new(key, label + b"\0" + data, hashlib.sha256).digest()


def proof(secret: str, role: str, t: bytes) -> bytes:
    """What ``role`` ("prefill" or "decode") sends to prove it holds the cluster secret."""
    return _mac(secret.encode(), role.encode(), t)


def check_proof(secret: str, role: str, t: bytes, presented: bytes) -> bool:
    return hmac.compare_digest(proof(secret, role, t), presented)


def session_key(secret: str, t: bytes) -> bytes:
    return _mac(secret.encode(), b"session", t)


def pairing_id(session: bytes) -> str:
    """A public name of the session (both sides derive it; it reveals nothing of the key)."""
    return _mac(session, b"pairing", b"")[:12].hex()


def seal(key: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The frames of one authenticated message."""
    seq_bytes = seq.to_bytes(SEQ_BYTES, "big")
    return [payload, seq_bytes, hmac.digest(key, seq_bytes + payload, "sha256")]


def open_seal(key: bytes, last_seq: int, frames: list[bytes]) -> int | None:
    """The sequence number of a valid ``[payload, seq, mac]`` newer than ``last_seq``; None if forged or replayed."""
    if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
        return None
    payload, seq_bytes, mac = frames
    if not hmac.compare_digest(hmac.digest(key, seq_bytes + payload, "sha256"), mac):
        return None
    seq = int.from_bytes(seq_bytes, "big")
    return seq if seq > last_seq else None


class DropCounter:
    """Messages dropped by authentication, by reason (e.g. "bad_mac", "unknown_peer", "bad_proof"). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
