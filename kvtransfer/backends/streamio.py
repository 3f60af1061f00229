"""Blocking byte-stream I/O for ``tcp``'s data connections: length-prefixed frames, and scatter/gather of whole
page views with ``sendmsg``/``recvmsg_into`` (no staging copy).

A frame is a u32 little-endian length and a msgpack body (``wire``). A view list is sent and received in batches of
``IOV_BATCH`` iovecs; a short ``sendmsg`` or ``recvmsg_into`` resumes inside the view it stopped in.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct

from kvtransfer.backends.wire import AnyDataMessage, decode, encode
from kvtransfer.backends.workers import TransferError

IOV_BATCH = 64
DISCARD_BYTES = 1 << 16
_LEN = struct.Struct("<I")


def send_frame(sock: socket.socket, msg: AnyDataMessage) -> None:
    body = encode(msg)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_views(sock, [memoryview(buf)])
    return bytes(buf)


def recv_frame(sock: socket.socket, max_bytes: int = 1 << 20) -> AnyDataMessage:
    """One frame; a declared length over ``max_bytes`` closes the connection before anything is allocated."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > max_bytes:
        raise TransferError(f"frame of {n} bytes exceeds the limit of {max_bytes}")
    return decode(recv_exact(sock, n))


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    i, off = _advance(views, 0, 0, 0)
    while i < len(views):
        i, off = _advance(views, i, off, sock.sendmsg(_batch(views, i, off)))


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill ``views`` from the stream. MSG_WAITALL: the kernel returns once the whole batch (up to IOV_BATCH views)
    is in, not whenever a segment lands, so a 512 MiB payload takes ~64 calls instead of ~1,400, and the Python
    between calls (and its GIL hand-offs to the process's other threads) stops paying per segment. A short return
    (a signal, the peer closing, a shutdown from another thread) is accounted for like any other."""
    i, off = _advance(views, 0, 0, 0)
    while i < len(views):
        got = sock.recvmsg_into(_batch(views, i, off), 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("connection closed by peer")
        i, off = _advance(views, i, off, got)


def _batch(views: list[memoryview], i: int, off: int) -> list[memoryview]:
    """Up to IOV_BATCH views from byte ``off`` of view ``i`` on."""
    batch = views[i:i + IOV_BATCH]
    if off:
        batch[0] = batch[0][off:]
    return batch


def _advance(views: list[memoryview], i: int, off: int, moved: int) -> tuple[int, int]:
    """The position (view, byte offset in it) ``moved`` bytes past (``i``, ``off``), skipping empty views."""
    while moved and i < len(views):
        rest = len(views[i]) - off
        if moved >= rest:
            moved, i, off = moved - rest, i + 1, 0
        else:
            off, moved = off + moved, 0
    while i < len(views) and len(views[i]) == 0:
        i += 1
    return i, off


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle prefill-side connection is dead. The decode side sends only acks, so between jobs any
    readable state (EOF, a reset, stray bytes) means the stream cannot carry another job."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable)
    except (OSError, ValueError):
        return True


def discard(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` through one bounded buffer."""
    buf = memoryview(bytearray(min(nbytes, DISCARD_BYTES)))
    while nbytes > 0:
        step = min(nbytes, len(buf))
        recv_views(sock, [buf[:step]])
        nbytes -= step


def shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by the peer
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
