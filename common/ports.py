"""Ports a process picks for the servers it starts (``pdcluster up``, tests, benchmarks).

A port is picked now and bound later, by a child, after it loaded its model. In between, any bind to port 0 on the
host (TCPStores, KV listeners, outgoing sockets) draws from the kernel's ephemeral range and could take it. So a
picked port is free now and outside that range; only another picker can collide, and picks are random.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)
LOWEST = 10000  # below: well-known and registered services' ports
_rng = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def pick_free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    lo, hi = ephemeral_range()
    spans = [(LOWEST, lo - 1)] if lo - 1 > LOWEST + 1000 else []
    spans += [(hi + 1, 65535)] if 65535 - hi > 1000 else []
    for _ in range(attempts if spans else 0):
        first, last = _rng.choice(spans)
        port = _rng.randint(first, last)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room outside the ephemeral range: the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])
