"""The tokenize pool's IPC schema (router <-> tokenize worker process) and its framing on a pipe.

Each frame is a 4-byte big-endian length then a msgpack-encoded struct. The worker answers every ``TokenizeJob``
with exactly one ``TokenizeResult``, in order; a worker's first frame is a ``TokenizeResult`` with no ids (ready).
"""

from __future__ import annotations

import msgspec


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class TokenizeJob(msgspec.Struct, frozen=True):
    """Exactly one of ``text`` (encoded as is) or ``messages`` (chat template, then encoded)."""

    text: str | None = None
    messages: list[ChatMessage] | None = None


class TokenizeResult(msgspec.Struct, frozen=True):
    """``ids``: the token ids as little-endian uint32; ``invalid``: the client's input was refused (its message)."""

    ids: bytes = b""
    invalid: str = ""


HEADER_BYTES = 4
ENCODER = msgspec.msgpack.Encoder()
JOB_DECODER = msgspec.msgpack.Decoder(TokenizeJob)
RESULT_DECODER = msgspec.msgpack.Decoder(TokenizeResult)


def frame(msg: msgspec.Struct) -> bytes:
    body = ENCODER.encode(msg)
    return len(body).to_bytes(HEADER_BYTES, "big") + body
