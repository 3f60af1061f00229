"""Bounds on a listener's connections that have not proven anything yet (no hello, no credential): at most
``per_peer`` from one remote host and ``total`` in all.

A new connection is always taken; at a bound, the slot of an older unauthenticated connection is reclaimed and that
connection closed (the pre-auth state is what the bound protects, so the newest arrival is worth as much as the
oldest, and only the oldest has had its chance to authenticate):

- at the per-peer bound, the oldest connection of the same host;
- at the total bound, the oldest connection of the host holding the most slots.

So a flood displaces its own connections first: a client that authenticates promptly is not starved by any number
of flooding hosts, since it would have to be the oldest unauthenticated connection of the largest holder to be
closed, and a connection that authenticated holds no slot at all.

Invariant: every ``Slot`` that ``admit`` returned leaves the counts exactly once: on ``release`` (authentication or
close, whichever comes first; later calls do nothing) or when it is reclaimed, so the counts return to zero when the
connections are gone. A reclaimed connection's ``close`` is called outside the lock (it may call ``release``).
Thread-safe (the metrics port and the tcp KV listener serve from threads).
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PRE_AUTH_PER_PEER = 32  # e.g. a router's few connections, a probe, reconnects in flight; many times over
PRE_AUTH_TOTAL = 256
HELLO_FRAME_BYTES = 4 << 10  # a hello (credential, ids, a proof) is well under 1 KB; nothing larger before it
HELLO_DEADLINE_S = 5.0  # a connection proves itself (hello, or a whole request's headers) within this
_WARN_EVERY_S = 10.0
_SEQ = operator.attrgetter("seq")


def peer_host(peername: object) -> str:
    """The host part of a transport's ``peername`` (a unix socket or a missing name: "")."""
    return str(peername[0]) if isinstance(peername, tuple) and peername else ""


class Slot:
    """One unauthenticated connection's hold on a ``ConnectionBudget``."""

    __slots__ = ("close", "held", "host", "seq")

    def __init__(self, host: str, close: Callable[[], None], seq: int) -> None:
        self.host = host
        self.close = close  # drops the connection (called when its slot is reclaimed)
        self.seq = seq  # admission order
        self.held = True


class ConnectionBudget:
    def __init__(self, what: str, per_peer: int = PRE_AUTH_PER_PEER, total: int = PRE_AUTH_TOTAL) -> None:
        assert per_peer >= 1 and total >= 1
        self.what = what  # the listener, for the log line ("the Mux socket", "the metrics port")
        self.per_peer = per_peer
        self.total = total
        self.reclaimed = 0  # connections closed to make room for a newer one, since start
        self._by_peer: dict[str, dict[Slot, None]] = {}  # host -> its slots, oldest first
        self._count = 0
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._warned_at = -_WARN_EVERY_S

    @property
    def count(self) -> int:
        return self._count

    def admit(self, host: str, close: Callable[[], None]) -> Slot:
        """A slot for a new connection from ``host``; ``close`` drops that connection should its slot be reclaimed
        for a later one."""
        with self._lock:
            slot = Slot(host, close, next(self._seq))
            victim = self._victim(host)
            if victim is not None:
                self._drop(victim)
                self.reclaimed += 1
            self._by_peer.setdefault(host, {})[slot] = None
            self._count += 1
            now = time.monotonic()
            warn = victim is not None and now - self._warned_at >= _WARN_EVERY_S
            if warn:
                self._warned_at = now
        if victim is not None:
            victim.close()
        if warn:  # at most one line per _WARN_EVERY_S: a flood must not become a log flood
            assert victim is not None
            logger.warning("%s: at its bound of unauthenticated connections (%d per peer, %d in all): closed the "
                           "oldest from %s for one from %s (%d closed so far)", self.what, self.per_peer, self.total,
                           victim.host or "?", host or "?", self.reclaimed)
        return slot

    def release(self, slot: Slot) -> None:
        """``slot``'s connection authenticated or closed (a released or reclaimed slot: nothing to do)."""
        with self._lock:
            if slot.held:
                self._drop(slot)

    def _victim(self, host: str) -> Slot | None:
        own = self._by_peer.get(host)
        if own is not None and len(own) >= self.per_peer:
            return next(iter(own))
        if self._count < self.total:
            return None
        most = max(map(len, self._by_peer.values()))
        return min((next(iter(slots)) for slots in self._by_peer.values() if len(slots) == most),
                   key=_SEQ)

    def _drop(self, slot: Slot) -> None:
        slot.held = False
        slots = self._by_peer[slot.host]
        del slots[slot]
        if not slots:
            del self._by_peer[slot.host]
        self._count -= 1
