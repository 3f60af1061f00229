"""The fixed-size metadata record that travels with a request's last chunk, and the decode-side slots it lands in.

One slot per in-flight request (``KVArgs.num_metadata_slots``). A slot holds the room it was written for; the
receiver checks it against its own room before use (a mismatch is context corruption, never silently accepted)
and zeroes the slot when the room is cleared, so a stale record can never validate for a later room.
"""

from __future__ import annotations

import threading

import msgspec
import numpy as np

MAX_TOP_LOGPROBS = 20

SLOT_DTYPE = np.dtype([
    ("room", np.uint64),
    ("first_token", np.int32),
    ("logprob", np.float32),
    ("cached_tokens", np.int32),
    ("num_top", np.int32),
    ("top_ids", np.int32, (MAX_TOP_LOGPROBS,)),
    ("top_logprobs", np.float32, (MAX_TOP_LOGPROBS,)),
])


class MetadataRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill facts decode needs to continue the request."""

    room: int  # the bootstrap room it belongs to (validated by the receiver)
    first_token: int  # the token prefill sampled
    logprob: float = 0.0  # its logprob
    cached_tokens: int = 0  # prompt tokens prefill found in its prefix cache
    top_ids: tuple[int, ...] = ()  # top logprobs of the first position, if asked (<= MAX_TOP_LOGPROBS)
    top_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs) or len(self.top_ids) > MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs: need equal lengths <= {MAX_TOP_LOGPROBS}, got "
                             f"{len(self.top_ids)} ids and {len(self.top_logprobs)} values")


class MetadataBuffers:
    """``num_slots`` fixed-size records; written by the control thread, read by the scheduler thread."""

    def __init__(self, num_slots: int) -> None:
        self.slots = np.zeros(num_slots, dtype=SLOT_DTYPE)
        self._lock = threading.Lock()

    def write(self, slot: int, record: MetadataRecord) -> None:
        n = len(record.top_ids)
        with self._lock:
            row = self.slots[slot]
            row["room"], row["first_token"], row["logprob"] = record.room, record.first_token, record.logprob
            row["cached_tokens"], row["num_top"] = record.cached_tokens, n
            row["top_ids"][:n], row["top_logprobs"][:n] = record.top_ids, record.top_logprobs

    def read(self, slot: int) -> MetadataRecord:
        with self._lock:
            row = self.slots[slot].copy()
        n = int(row["num_top"])
        return MetadataRecord(room=int(row["room"]), first_token=int(row["first_token"]),
                              logprob=float(row["logprob"]), cached_tokens=int(row["cached_tokens"]),
                              top_ids=tuple(int(x) for x in row["top_ids"][:n]),
                              top_logprobs=tuple(float(x) for x in row["top_logprobs"][:n]))

    def room_of(self, slot: int) -> int:
        with self._lock:
            return int(self.slots[slot]["room"])

    def clear(self, slot: int) -> None:
        with self._lock:
            self.slots[slot] = np.zeros((), dtype=SLOT_DTYPE)
