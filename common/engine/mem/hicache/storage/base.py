"""The interface of a storage backend, and the record every backend stores: one KV page behind a checked header.

Keys are a hash chain over pages (``storage_tier``): page ``i``'s key is ``sha256(key[i - 1] + its token ids)``, and
the chain starts from a hash of the model fingerprint, so a key names a whole token prefix of one model, dtype,
page size and TP shard. A record is::

    magic (6) | key (32) | payload length (8, little endian) | blake2b-128 of the payload (16) | payload

``decode_record`` returns the payload only if all of it checks out (a truncated, corrupted or misplaced record reads
as a miss: the page is recomputed).
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod

MAGIC = b"PDKV\x01\x00"
_HEADER = struct.Struct("<6s32sQ16s")


class StorageBackend(ABC):
    """A key -> bytes store shared by the nodes of one model. Called from the storage tier's threads only."""

    @abstractmethod
    def get(self, key: str) -> bytearray | None:
        """The record under ``key`` (a buffer the caller may keep), or None when there is none."""

    @abstractmethod
    def set(self, key: str, record: bytes) -> bool:
        """Store ``record`` under ``key`` (readers never see a partial record); whether it was stored."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def remove(self, key: str) -> None:
        """Drop the record (a corrupted one, so that a later write replaces it)."""

    def close(self) -> None:  # noqa: B027  (optional: a default that does nothing)
        """Release connections and segments."""


def encode_record(key: bytes, payload: bytes) -> bytes:
    digest = hashlib.blake2b(payload, digest_size=16).digest()
    return _HEADER.pack(MAGIC, key, len(payload), digest) + payload


def decode_record(key: bytes, record: bytearray | None, payload_len: int) -> memoryview | None:
    if record is None or len(record) != _HEADER.size + payload_len:
        return None
    magic, stored_key, length, digest = _HEADER.unpack_from(record)
    payload = memoryview(record)[_HEADER.size:]
    if magic != MAGIC or stored_key != key or length != payload_len:
        return None
    if hashlib.blake2b(payload, digest_size=16).digest() != digest:
        return None
    return payload
