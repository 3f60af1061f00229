"""Bounds on a listener's connections that have not proven anything yet (no hello, no credential): at most
``per_peer`` from one remote host and ``total`` in all. A connection over either bound is closed at once, before
anything is read from it; one peer flooding a port cannot take the slots of another host.

Invariant: every ``admit`` that returned True is matched by exactly one ``release`` (on authentication or on
close, whichever comes first), so the counts return to zero when the connections are gone. Thread-safe (the
metrics port serves from threads).
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)

PRE_AUTH_PER_PEER = 32  # e.g. a router's few connections, a probe, reconnects in flight; many times over
PRE_AUTH_TOTAL = 256
HELLO_FRAME_BYTES = 4 << 10  # a hello (credential, ids, a proof) is well under 1 KB; nothing larger before it
HELLO_DEADLINE_S = 5.0  # a connection proves itself (hello, or a whole request's headers) within this
_WARN_EVERY_S = 10.0


def peer_host(peername: object) -> str:
    """The host part of a transport's ``peername`` (a unix socket or a missing name: "")."""
    return str(peername[0]) if isinstance(peername, tuple) and peername else ""


class ConnectionBudget:
    def __init__(self, what: str, per_peer: int = PRE_AUTH_PER_PEER, total: int = PRE_AUTH_TOTAL) -> None:
        self.what = what  # the listener, for the log line ("the Mux socket", "the metrics port")
        self.per_peer = per_peer
        self.total = total
        self.refused = 0  # connections closed for a bound, since start
        self._by_peer: dict[str, int] = {}
        self._count = 0
        self._lock = threading.Lock()
        self._warned_at = -_WARN_EVERY_S

    @property
    def count(self) -> int:
        return self._count

    def admit(self, host: str) -> bool:
        with self._lock:
            held = self._by_peer.get(host, 0)
            if held < self.per_peer and self._count < self.total:
                self._by_peer[host] = held + 1
                self._count += 1
                return True
            self.refused += 1
            now = time.monotonic()
            warn = now - self._warned_at >= _WARN_EVERY_S
            if warn:
                self._warned_at = now
        if warn:  # at most one line per _WARN_EVERY_S: a flood must not become a log flood
            logger.warning("%s: refused connections from %s (at most %d unauthenticated per peer, %d in all; %d "
                           "refused so far)", self.what, host or "?", self.per_peer, self.total, self.refused)
        return False

    def release(self, host: str) -> None:
        with self._lock:
            held = self._by_peer.get(host, 0)
            assert held > 0, f"{self.what}: release without admit for {host}"
            if held == 1:
                del self._by_peer[host]
            else:
                self._by_peer[host] = held - 1
            self._count -= 1
