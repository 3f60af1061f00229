"""The data-plane messages of the two-sided backends (``tcp``, ``nccl``; ``ucx`` sends only ``DataHello``) and the
pool's byte views.

Each transport frames these its own way (``tcp``: u32 length + msgpack; ``ucx``: ``send_obj``; ``nccl``: a length
tensor then the body), but the messages and their meaning are one::

    prefill -> decode   DataHello(instance_id, epoch, proof)        once per data connection
    prefill -> decode   ChunkHeader(room, chunk_id, dst_runs, heads, nbytes, ...) + payload   per job
    decode -> prefill   ChunkAck(room, chunk_id, error)              per job, after the payload landed (or was refused)

``ChunkHeader``'s payload-layout fields belong to one transport each: ``pack_bytes`` to the message transports
(``_twosided``), ``segment_pages`` to ``tcp``'s staged byte stream (``staging``); the others leave them 0.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import torch

from kvtransfer.args import KVArgs


class DataHello(msgspec.Struct, frozen=True, tag=True):
    """First message on a data connection: which prefill rank (start) is talking."""

    instance_id: str
    epoch: int
    proof: bytes = b""  # tcp: data_proof(secret, nonce, instance_id, epoch) over the listener's challenge


def data_proof(secret: str, nonce: bytes, instance_id: str, epoch: int) -> bytes:
    """HMAC of the cluster secret over the listener's nonce and the claimed rank start."""
    data = b"tcp-data\0" + nonce + b"\0" + instance_id.encode() + b"\0" + str(epoch).encode()
    return hmac.new(secret.encode(), data, hashlib.sha256).digest()


class ChunkHeader(msgspec.Struct, frozen=True, tag=True):
    room: int
    chunk_id: int
    dst_runs: list[tuple[int, int]]  # (first destination page, pages), in the job's run order
    heads: tuple[int, int, int] | None  # (src_head, dst_head, num_heads); None = whole pages
    nbytes: int  # payload bytes (a consistency check, and a bound the receiver enforces)
    pack_bytes: int = 0  # message transports: small slices packed up to this size; 0 = one message per slice
    segment_pages: int = 0  # tcp: > 0 = the payload is staged in segments of this many pages


class ChunkAck(msgspec.Struct, frozen=True, tag=True):
    room: int
    chunk_id: int
    error: str = ""


AnyDataMessage = DataHello | ChunkHeader | ChunkAck
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyDataMessage)


def encode(msg: AnyDataMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> AnyDataMessage:
    """Raises msgspec.DecodeError/ValidationError on bytes that are not a data-plane message."""
    return _decoder.decode(data)


def layer_buffers(args: KVArgs) -> list[torch.Tensor]:
    """The pool's buffers in payload order: K0, V0, K1, V1, ..."""
    return [buf for pair in zip(args.k_buffers, args.v_buffers, strict=True) for buf in pair]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view (dtype-agnostic transports; numpy has no bfloat16)."""
    return t.reshape(-1).view(torch.uint8)
