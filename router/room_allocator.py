"""Bootstrap rooms: random 63-bit integers, unique among the requests in flight on this router.

Random (not a counter) so that several router replicas practically never collide (2^-63 per pair); unique here by
construction. A room never encodes a DP rank: ranks are chosen by load and sent explicitly.
"""

from __future__ import annotations

import os
import random


class RoomAllocator:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(16), "little"))
        self.in_flight: set[int] = set()

    def acquire(self) -> int:
        while True:
            room = self._rng.getrandbits(63)
            if room and room not in self.in_flight:  # 0 is reserved: it reads as "unset" in logs and tools
                self.in_flight.add(room)
                return room

    def release(self, room: int) -> None:
        self.in_flight.discard(room)
