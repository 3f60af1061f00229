"""Control-plane messages between KV managers (ZMQ, msgpack via msgspec; a tagged union, never positional frames).

Every message names its kind (the ``kind`` tag), the protocol ``version`` and the sender's ``(instance_id, epoch)``:
``instance_id`` is stable for a rank at one address, ``epoch`` is new on every start. Every message after the
handshake carries a MAC under the session key of that (instance_id, epoch): a receiver drops (and counts) anything
else, so a forged epoch, heartbeat or room message changes nothing.

Flow of one room (D = decode rank, P = prefill rank)::

    D -> P  Hello(nonce, layout, endpoint)        once per peer epoch; challenge-response (kvtransfer/auth.py):
    P -> D  HelloChallenge -> D -> P HelloProof   each side proves the cluster secret without sending it;
    P -> D  HelloAck(accepted | reason)           the first message sealed with the session key
    D -> P  TransferInfo(room, dst_pages, slot)   P's sender: Bootstrapping -> WaitingForInput
    P -> D  ChunkDone(room, chunk_id, ...)        after the data plane put each chunk in D's pages;
                                                  the last one carries num_chunks and the MetadataRecord
                                                  (``signal`` > 0: sent once the chunk's copy was enqueued, where
                                                  the TransferInfo asked for it; D uses the chunk only once that
                                                  landing signal is set, kvtransfer/backends/signals.py)
    either  Abort(room, code, reason) -> AbortAck(room) the acker has no transfer of that room in flight any more
    D -> P  Status(room, Success, rooms)          D has every chunk and a valid record; P's sender: -> Success
                                                  (``rooms``: more rooms confirmed at once, one message per peer
                                                  for every room completed by the messages D handled together)
    P -> D  Status(room, Failed, code, reason)    P failed the room (transfer error, deadline)
    both    Heartbeat                             every heartbeat_interval_s to every accepted peer
"""

from __future__ import annotations

import msgspec

from common.errors import ErrorCode
from kvtransfer.args import KVLayout
from kvtransfer.metadata import MetadataRecord

PROTOCOL_VERSION = 4  # 4: KVLayout.extra (layer groups), MetadataRecord.draft_kv_len


class ControlMessage(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    version: int = PROTOCOL_VERSION
    instance_id: str  # sender's rank identity, stable across restarts on one address
    epoch: int  # sender's start time in ns; larger on every restart


class Hello(ControlMessage, tag="hello"):
    """Decode rank introduces itself to a prefill rank (the KV-args registration)."""

    control_addr: str  # where to send replies (the sender's ROUTER)
    nonce: bytes  # the decode's challenge; the cluster secret itself is never sent
    layout: KVLayout
    endpoint: dict[str, str]  # the sender's data-plane endpoint (KVBackend.endpoint())


class HelloChallenge(ControlMessage, tag="hello_challenge"):
    """Prefill's proof of the secret over both nonces, and its own challenge (``nonce``)."""

    hello_nonce: bytes  # the Hello's nonce, echoed
    nonce: bytes
    proof: bytes


class HelloProof(ControlMessage, tag="hello_proof"):
    """Decode's proof of the secret over both nonces; sent only after the prefill's proof checked out."""

    proof: bytes


class HelloAck(ControlMessage, tag="hello_ack"):
    """Prefill rank's answer; when refused, ``reason`` says why and nothing else is accepted from that epoch.
    Sealed with the session key, except a refusal of a failed proof, which echoes the Hello's nonce instead."""

    accepted: bool
    hello_nonce: bytes = b""
    reason: str = ""
    layout: KVLayout | None = None
    endpoint: dict[str, str] = {}


class TransferInfo(ControlMessage, tag="transfer_info"):
    """Where one room's KV goes on one decode rank."""

    room: int
    dst_pages: list[int]  # destination page numbers, in token order; 0: held there already, not moved
    metadata_slot: int
    landing_signals: bool = False  # D reads this prefill rank's landing signals: ChunkDone may precede the landing


class ChunkDone(ControlMessage, tag="chunk_done"):
    """Chunk ``chunk_id`` of ``room`` is in the destination pages."""

    room: int
    chunk_id: int
    num_pages: int
    num_chunks: int = 0  # set on the last message: the total number of chunks
    metadata: MetadataRecord | None = None  # set on the last message by the metadata writer
    signal: int = 0  # > 0: the chunk's copy is enqueued; it is in the pages once this landing signal is set


class Status(ControlMessage, tag="status"):
    """A room's state changed in a way the peer must know: decode's Success confirmation, prefill's Failed."""

    room: int
    state: int
    rooms: list[int] = []  # Success: more rooms confirmed by this one message (decode batches its confirmations)
    reason: str = ""
    code: ErrorCode = ErrorCode.UNAVAILABLE  # of a Failed state: the failure's code, which the peer's room takes


class Abort(ControlMessage, tag="abort"):
    room: int
    reason: str
    code: ErrorCode = ErrorCode.CANCELLED  # the aborting room's failure code, which the peer's room takes


class AbortAck(ControlMessage, tag="abort_ack"):
    """No transfer of ``room`` is in flight on the acking side; the peer may reuse the room's pages."""

    room: int


class Heartbeat(ControlMessage, tag="heartbeat"):
    pass


AnyMessage = Hello | HelloChallenge | HelloProof | HelloAck | TransferInfo | ChunkDone | Status | Abort | AbortAck | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(msg: AnyMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> AnyMessage:
    """Raises msgspec.DecodeError/ValidationError on bytes that are not a known message."""
    return _decoder.decode(data)
