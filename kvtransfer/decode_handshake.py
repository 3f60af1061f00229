"""``DecodeHandshakes``: a decode rank's handshakes with the prefill ranks its rooms take KV from.

A Hello goes out once per prefill rank start (again after ``HELLO_RESEND_S`` while unanswered); the prefill's
challenge is checked against the cluster secret before our proof goes out, and a HelloAck sealed with the session key
both derived accepts the peer (``kvtransfer/auth.py``). A prefill that refused us, could not prove the secret or
whose layout is incompatible stays in ``refused``, which fails the rooms waiting on it (``decode_rooms``). Every
outcome calls ``on_change``, so the rooms waiting on a handshake move on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtransfer import auth
from kvtransfer.args import incompatibility
from kvtransfer.backends.base import PeerKey
from kvtransfer.bootstrap import RankEntry
from kvtransfer.messages import Hello, HelloAck, HelloChallenge, HelloProof

if TYPE_CHECKING:
    from kvtransfer.manager import KVManager

log = logging.getLogger(__name__)

HELLO_RESEND_S = 1.0


@dataclass
class Connecting:
    entry: RankEntry
    hello_at: float
    nonce: bytes  # our Hello's challenge
    session: bytes = b""  # set once the prefill proved the secret and we sent our proof
    prefill_epoch: int = 0


class DecodeHandshakes:
    def __init__(self, mgr: KVManager, on_change: Callable[[], None]) -> None:
        self.mgr = mgr
        self.on_change = on_change
        self.connecting: dict[str, Connecting] = {}  # instance_id -> handshake in progress
        self.refused: dict[str, str] = {}  # instance_id@epoch -> why the prefill refused us

    def hello(self, entry: RankEntry, now: float) -> None:
        """Start (or resend) the handshake with ``entry``'s prefill rank. Called with ``mgr.lock`` held."""
        conn = self.connecting.get(entry.instance_id)
        if conn is not None and now - conn.hello_at < HELLO_RESEND_S:
            return
        conn = self.connecting[entry.instance_id] = Connecting(entry, now, auth.new_nonce())
        self.mgr.control.send(entry.control_addr, Hello(
            **self.mgr.stamp(), control_addr=self.mgr.control.address, nonce=conn.nonce, layout=self.mgr.layout,
            endpoint=self.mgr.endpoint))

    def handle(self, msg: Hello | HelloChallenge | HelloProof | HelloAck, frames: list[bytes]) -> None:
        """Check the prefill's proof before proving ours; accept it on a HelloAck sealed with our session key."""
        if isinstance(msg, HelloChallenge):
            self._challenged(msg)
            return
        if not isinstance(msg, HelloAck):
            return
        with self.mgr.lock:
            conn = self.connecting.get(msg.instance_id)
            seq = None
            if conn is not None and conn.session and msg.epoch == conn.prefill_epoch:
                seq = auth.open_seal(conn.session, 0, frames)
            refusal = conn is not None and not msg.accepted and msg.hello_nonce == conn.nonce  # a failed proof
            if conn is None or (seq is None and not refusal):
                self.mgr.auth_drops.add("bad_mac")
                return
            del self.connecting[msg.instance_id]
            if not msg.accepted:
                self.refused[msg.instance_id] = msg.reason
            elif msg.layout is not None and (reason := incompatibility(msg.layout, self.mgr.layout)):
                self.refused[msg.instance_id] = reason
            else:
                self.refused.pop(msg.instance_id, None)
        if msg.accepted and seq is not None and msg.instance_id not in self.refused and msg.layout is not None:
            self.mgr.accept_peer(PeerKey(msg.instance_id, msg.epoch), conn.entry.control_addr, msg.layout,
                                 msg.endpoint, conn.session, recv_seq=seq)
        self.on_change()

    def _challenged(self, msg: HelloChallenge) -> None:
        secret = self.mgr.config.cluster_token
        with self.mgr.lock:
            conn = self.connecting.get(msg.instance_id)
            if conn is None or msg.hello_nonce != conn.nonce or conn.session or msg.epoch < conn.entry.epoch:
                self.mgr.auth_drops.add("unknown_handshake")
                return
            t = auth.transcript(self.mgr.instance_id, self.mgr.epoch, conn.nonce, msg.instance_id, msg.epoch,
                                msg.nonce)
            if not auth.check_proof(secret, "prefill", t, msg.proof):
                self.mgr.auth_drops.add("bad_proof")
                del self.connecting[msg.instance_id]
                self.refused[msg.instance_id] = (f"cluster token mismatch: prefill rank {msg.instance_id} could not "
                                                 "prove this cluster's secret")
                log.warning("kv %s: %s", self.mgr.instance_id, self.refused[msg.instance_id])
            else:
                conn.session, conn.prefill_epoch = auth.session_key(secret, t), msg.epoch
                self.mgr.control.send(conn.entry.control_addr, HelloProof(
                    **self.mgr.stamp(), proof=auth.proof(secret, "decode", t)))
                return
        self.on_change()
